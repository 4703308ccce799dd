"""Cache keys for graphshard's compiles: stable across processes and ranks, and complete.

Three things here, each so that a second launch of the same job (or another rank) reuses
compiled code, and never reuses code it must not:

- :func:`meshes_pickle_without_hash`: a stable Inductor FX-graph key for graphs that hold a
  ``DeviceMesh`` (below);
- :func:`plan_in_cache_key`: graphshard's plan and source in the keys, for the backend option
  ``aot_cache`` (AOTAutogradCache knows nothing of the partitioner and passes graphshard hands
  it);
- :func:`aot_cacheable`: the compilers marked serialisable, which is what lets AOTAutogradCache
  store and answer graphshard's graphs at all.

DTensor parameters put their ``DeviceMesh`` into the traced graphs as opaque inputs, and
Inductor's FX-graph cache pickles those inputs into its key. ``DeviceMesh.__getstate__``
keeps the mesh's cached ``_hash``, Python's ``hash()`` of a tuple that holds strings, which
is randomised per process (``PYTHONHASHSEED``). So every process computed a new key and the
cache never hit for a graphshard graph: every restart, every rank and every test recompiled
from scratch. While graphshard's backend compiles, meshes pickle without that field; the rest
of the mesh (ranks, layout, device type, dimension names, group names) stays in the key.

The mesh also records this process's rank (``_rank``, ``_coordinate_on_dim``), so rank 0's
and rank 1's keys differed for the very same compiled code, and one rank's artifacts
(:mod:`graphshard.compiler.share`) could never hit on another. Those fields leave the key too.
That is safe: a mesh is an input of the compiled graph, read at run time from the live
object; whatever tracing took from it (a rank, a coordinate) is a constant in the graph's code,
which is in the key.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["PER_PROCESS_FIELDS", "aot_cacheable", "inner_tensor_layouts",
           "meshes_pickle_without_hash",
           "plan_in_cache_key", "plan_out_of_fx_key", "source_digest"]

# ``_hash``: per-process hash seed (recomputed lazily by ``__hash__``); ``_rank`` and
# ``_coordinate_on_dim``: this process's place in the mesh.
PER_PROCESS_FIELDS = ("_hash", "_rank", "_coordinate_on_dim")


@contextlib.contextmanager
def meshes_pickle_without_hash() -> Iterator[None]:
    """Within the block, pickling a ``DeviceMesh`` leaves out what differs per process
    (:data:`PER_PROCESS_FIELDS`)."""
    original = DeviceMesh.__getstate__

    def getstate(mesh: DeviceMesh) -> dict:
        state = dict(original(mesh))
        for name in PER_PROCESS_FIELDS:
            state.pop(name, None)
        return state

    DeviceMesh.__getstate__ = getstate
    try:
        yield
    finally:
        DeviceMesh.__getstate__ = original


_SOURCE_DIGEST: str | None = None


def source_digest() -> str:
    """SHA-256 of graphshard's and its passes' Python source (every ``.py`` file under the
    ``graphshard`` package and the passes package): pass output depends on this code."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        import graphshard.passes as passes_package

        h = hashlib.sha256()
        package_root = Path(__file__).resolve().parents[1]  # graphshard/
        for root in (package_root, Path(passes_package.__file__).resolve().parent):
            for path in sorted(root.rglob("*.py")):
                h.update(str(path.relative_to(root)).encode())
                h.update(path.read_bytes())
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


class _GraphshardKey(CustomGraphPass):
    """A pass that does nothing and exists for its :meth:`uuid`: set as Inductor's
    ``joint_custom_pre_pass`` (which graphshard's path never runs: it calls
    ``compile_fx_inner``, after the joint graph), it carries graphshard's plan and source
    into AOTAutograd's and Inductor's cache keys."""

    def __init__(self, digest: str, chained: Any) -> None:
        self.digest = digest
        self.chained = chained

    def __call__(self, graph: Any) -> None:
        if self.chained is not None:
            self.chained(graph)

    def uuid(self) -> Any:
        chained = self.chained.uuid() if self.chained is not None else None
        return (self.digest, chained)


def inner_tensor_layouts(inputs: Sequence[Any]) -> list[Any]:
    """Shape, strides, offset, dtype and device of every tensor inside each tensor-subclass
    input (a DTensor's local shard), in input order; None for any other input.

    AOTAutogradCache keys a subclass input by its outer metadata (a DTensor's global shape
    and placements), not by the tensors it wraps, yet the compiled code asserts the local
    shard's size. Ranks of an uneven split hold shards of different sizes for one global
    shape: without these layouts in the key, one rank's entry answered another's graph and
    failed its size check at run time."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def layout(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):  # an opaque inner object (a DeviceMesh)
            return None
        if not is_traceable_wrapper_subclass(t):
            return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), str(t.dtype),
                    str(t.device))
        names, _ = t.__tensor_flatten__()
        return tuple((name, layout(getattr(t, name))) for name in names)

    return [layout(t) if isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t)
            else None for t in inputs]


@contextlib.contextmanager
def plan_in_cache_key(plan: Any, inputs: Sequence[Any] = ()) -> Iterator[None]:
    """Within the block, AOTAutograd's and Inductor's cache keys include ``plan`` (its repr),
    graphshard's source (:func:`source_digest`), the default process group's backend and
    size, and the local layouts of the subclass ``inputs`` (:func:`inner_tensor_layouts`):
    everything besides the Dynamo graph that decides what graphshard's passes produce.

    Why: AOTAutogradCache keys an entry by the Dynamo graph and the compile configuration
    only; a custom partitioner and the compilers graphshard hands AOTAutograd are not in it,
    so without this a changed plan or a changed pass would silently reuse stale code."""
    import torch.distributed as dist
    from torch._inductor import config

    group = (str(dist.get_backend()), dist.get_world_size()) \
        if dist.is_available() and dist.is_initialized() else None
    digest = hashlib.sha256(repr((plan, group, source_digest(),
                                  inner_tensor_layouts(inputs))).encode()).hexdigest()
    current = config.joint_custom_pre_pass
    if isinstance(current, _GraphshardKey):
        current = current.chained
    with config.patch(joint_custom_pre_pass=_GraphshardKey(digest, current)):
        yield


def aot_cache_unsupported() -> str | None:
    """Why AOTAutogradCache cannot answer graphshard's graphs on the installed torch, or None
    where it can (torch 2.13 and 2.14 can).

    torch 2.11's Dynamo records ``DTensor.to_local()`` as a call of a function it makes on the
    fly (``prim_to_local``, from ``TensorVariable.method_to_local``), which AOTAutogradCache
    refuses: every graph reading a sharded parameter bypasses the cache
    (pytorch/pytorch#167349). Later versions trace ``to_local`` like any method."""
    from torch._dynamo.variables.tensor import TensorVariable

    if hasattr(TensorVariable, "method_to_local"):
        return (
            f"aot_cache=True needs a torch whose AOTAutogradCache accepts DTensor.to_local() "
            f"(torch 2.13 or newer); torch {torch.__version__}'s bypasses every graph that "
            "reads a sharded parameter (pytorch/pytorch#167349). Upgrade torch or leave "
            "aot_cache off (Inductor's FX-graph cache still serves warm restarts)."
        )
    return None


def aot_cacheable(compilers: dict[str, Any]) -> dict[str, Any]:
    """``compilers`` (``fw_compiler``, ``bw_compiler``, ``inference_compiler`` returning
    Inductor's compiled graphs) marked serialisable, which is what turns AOTAutogradCache on
    for a backend built with ``aot_autograd``."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
    from torch._inductor.output_code import OutputCode

    return {name: SerializableAOTDispatchCompiler(OutputCode, fn)
            for name, fn in compilers.items()}


@contextlib.contextmanager
def plan_out_of_fx_key() -> Iterator[None]:
    """Within the block, Inductor's FX-graph key leaves out what :func:`plan_in_cache_key`
    added: the graph Inductor compiles is the passes' output, a complete key by itself, so a
    change of graphshard's source that leaves a graph unchanged still hits."""
    from torch._inductor import config

    current = config.joint_custom_pre_pass
    if not isinstance(current, _GraphshardKey):
        yield
        return
    with config.patch(joint_custom_pre_pass=current.chained):
        yield
