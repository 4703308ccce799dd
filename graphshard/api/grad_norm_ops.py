"""``clip_grad_norm_`` on graphshard's gradients: the per-gradient norms on the local tensors.

``torch.nn.utils.clip_grad_norm_`` (and ``get_total_norm``) starts with
``_foreach_norm(grads)``, one norm per gradient. On DTensor gradients that call goes through
DTensor's dispatch, which propagates a sharding for every gradient and wraps each norm into a
DTensor of its own, through DTensor's constructor: at llama-1b's 147 gradients
(``--model tiny-deep``) on this machine's CPU, 0.52 ms against 0.32 ms for the same norms on
the local tensors (``docs/benchmark-log.md``). The answer never needs that work: the norm of a
tensor that is sharded or replicated is its local norm, partial over the mesh dimensions it
is sharded on. (The clip's other list ops, the stack of the norms and the scaling, DTensor's
own fast path serves as fast as a handler could.)

So :func:`run_grad_norm_ops_locally` (``shard()`` calls it) registers a handler for
``_foreach_norm`` with DTensor's dispatcher (``DTensor._op_dispatcher._custom_op_handlers``,
the hook torch's own ``loss_parallel`` uses), once per process. It serves a call whose
tensors are all DTensors on graphshard's meshes, outside a compile:

- The first call with a given list of spec objects goes through DTensor's own dispatch. Its
  output specs are remembered where they show the norms were computed locally: each input
  sharded or replicated on every mesh dimension (no ``Partial``), each output partial where
  its input is sharded and replicated where it is replicated, on the same mesh, and the
  outputs equal the norms of the local tensors.
- Later calls with the same spec objects (graphshard's gradients carry their parameters'
  specs, so every step's do) take the norms of the local tensors and wrap them on the
  remembered specs, without DTensor's constructor.

The result is DTensor's own, bit for bit (tested); any other call, and DTensors of other
meshes (FSDP2's, for one: a peer in the same process is measured as its users run it), go
through DTensor's dispatch unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from graphshard.api.dtensor_handlers import (
    handlers_aside,
    same_mesh,
    through_dtensor,
    wrap_local,
)

__all__ = ["dtensor_dispatch", "run_grad_norm_ops_locally"]

aten = torch.ops.aten
_NORMS = aten._foreach_norm.Scalar

_spec_of = attrgetter("_spec")
_local_of = attrgetter("_local_tensor")

_lock = threading.Lock()
# id of a mesh of graphshard's parameters -> how many live sharded models use it
_MESHES: Counter[int] = Counter()
# the mesh ids of sharded models found garbage, counted down in _MESHES under the lock later
# (by :func:`_reap`): a finalizer runs inside whatever allocation started the collection,
# possibly while this thread holds the lock, so it must never take it
_DEAD: list[set[int]] = []
# (the list's spec ids, the other arguments) -> (the list's specs, which keep the ids valid;
# the norms' specs)
_KNOWN: dict[tuple, tuple[list, list]] = {}
_KNOWN_MAX = 256


def run_grad_norm_ops_locally(root: torch.nn.Module, meshes: Iterable[Any]) -> None:
    """From now on, this process takes ``_foreach_norm`` of DTensors on ``meshes`` (those of
    ``root``'s sharded parameters, until ``root`` is garbage) on their local tensors wherever
    that gives DTensor's own result (module docstring). The handler stands aside where the op
    already has another."""
    ids = {id(mesh) for mesh in meshes}
    # outside the lock: making the finalizer may start a collection, which runs the
    # finalizers of models that are garbage (a hang until 2026-12-03)
    weakref.finalize(root, _forget, ids)
    with _lock:
        _reap()
        _MESHES.update(ids)
    DTensor._op_dispatcher._custom_op_handlers.setdefault(_NORMS, _norms)


def dtensor_dispatch() -> contextlib.AbstractContextManager[None]:
    """Within, ``_foreach_norm`` goes through DTensor's own dispatch again (the benchmark's
    and the tests' reference)."""
    return handlers_aside(_norms)


def _forget(ids: set[int]) -> None:
    """A sharded model is garbage (its finalizer): the remembered specs (which hold meshes)
    go, and its meshes are set aside for :func:`_reap`. Takes no lock: the collection that
    runs this may have started inside this very thread's critical section."""
    _DEAD.append(ids)
    _KNOWN.clear()


def _reap() -> None:
    """The meshes of models found garbage stop counting (the caller holds the lock)."""
    while _DEAD:
        ids = _DEAD.pop()
        _MESHES.subtract(ids)
        for mesh_id in ids:
            if _MESHES[mesh_id] <= 0:
                del _MESHES[mesh_id]


def _owned(spec: Any) -> bool:
    return id(spec.mesh) in _MESHES


def _reduced_locally(source: Any, result: Any) -> bool:
    """Whether ``result`` is the spec a full reduction of a tensor on ``source`` has when
    computed on its local tensor: the same mesh, partial where ``source`` is sharded,
    replicated where it is replicated."""
    if not same_mesh(result.mesh, source.mesh) or len(result.placements) != len(
            source.placements):
        return False
    return all((p.is_shard() and q.is_partial()) or (p.is_replicate() and q.is_replicate())
               for p, q in zip(source.placements, result.placements, strict=True))


def _norms(op: Any, args: tuple, kwargs: dict) -> Any:
    """``_foreach_norm(tensors, ord, dtype=...)``: the local tensors' norms, on the specs
    remembered for the list's specs (module docstring)."""
    tensors = args[0]
    if torch.compiler.is_compiling() or not isinstance(tensors, (list, tuple)) or not tensors:
        return through_dtensor(op, args, kwargs)
    try:
        specs = list(map(_spec_of, tensors))
    except AttributeError:  # a plain tensor among them
        return through_dtensor(op, args, kwargs)
    key = (tuple(map(id, specs)), args[1:], tuple(kwargs.items()))
    known = _KNOWN.get(key)
    if known is not None:
        norms = op(list(map(_local_of, tensors)), *args[1:], **kwargs)
        return [wrap_local(norm, spec) for norm, spec in zip(norms, known[1], strict=True)]
    out = through_dtensor(op, args, kwargs)
    with _lock:
        _reap()
    if (all(map(_owned, specs))
            and all(isinstance(norm, DTensor) and _reduced_locally(spec, norm._spec)
                    for spec, norm in zip(specs, out, strict=True))
            and all(torch.equal(mine, theirs._local_tensor) for mine, theirs in zip(
                op(list(map(_local_of, tensors)), *args[1:], **kwargs), out, strict=True))):
        if len(_KNOWN) >= _KNOWN_MAX:
            _KNOWN.clear()
        _KNOWN[key] = (specs, [norm._spec for norm in out])
    return out
