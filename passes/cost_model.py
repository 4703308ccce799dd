"""Analytic costs of graph nodes: α-β ring collectives, matmul FLOPs, memory-bound ops.

The scheduling passes and the simulator need to compare communication with computation on
graphs that are only ever traced with fake tensors, so every cost here comes from shapes in
``node.meta["val"]`` and a :class:`HardwareProfile`; nothing runs and no process group is
needed. Builtin profiles hold published peak figures; a calibrated JSON profile (measured on
the real machine) overrides the builtin of the same name.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar

import torch
from torch import fx

from graphshard.passes.errors import GraphshardValueError, UnpricedSizeError
from graphshard.passes.markers import ALL_GATHER_SINGLE, TAKE_PREFETCHED
from graphshard.passes.regions import is_region_call, region_body

__all__ = [
    "HardwareProfile",
    "PROFILES",
    "all_gather_time",
    "all_reduce_time",
    "all_to_all_time",
    "collective_bytes_per_rank",
    "collective_group",
    "collective_kind",
    "collective_ranks",
    "GROUP_RANKS",
    "get_profile",
    "node_flops",
    "node_time",
    "profile_dir",
    "reduce_scatter_time",
    "save_profile",
    "tensor_bytes",
]

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class HardwareProfile:
    """What one rank can do per second, and what one ring hop costs."""

    name: str
    alpha_s: float  # latency of one ring hop (one step of a ring collective), seconds
    bandwidth_Bps: float  # per-rank link bandwidth in one direction, bytes/s
    peak_flops: float  # dense matmul FLOP/s assumed for FLOP-carrying ops
    mem_bandwidth_Bps: float  # memory bandwidth for memory-bound ops, bytes/s
    source: str = ""
    # host <-> device link in one direction, bytes/s (CPU offload's copies); None: the
    # device is the host (memory bandwidth)
    host_link_Bps: float | None = None
    # A cluster of nodes of ``node_size`` ranks: ``alpha_s`` and ``bandwidth_Bps`` are then
    # the links within a node, and a group whose ranks span nodes runs at these instead.
    # None: every group runs at ``alpha_s`` and ``bandwidth_Bps``.
    node_size: int | None = None
    inter_node_alpha_s: float | None = None
    inter_node_Bps: float | None = None

    def host_copy_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` between host and device memory (CPU offload)."""
        return nbytes / (self.host_link_Bps or self.mem_bandwidth_Bps)

    def spans_nodes(self, n: int, ranks: Sequence[int] | None = None) -> bool:
        """Whether a group of ``n`` ranks (global ``ranks``, where known) spans nodes: ranks
        ``0..node_size-1`` make the first node. Without its ranks, a group larger than a
        node does; a smaller one is taken to be within one."""
        if self.node_size is None:
            return False
        if ranks:
            return len({r // self.node_size for r in ranks}) > 1
        return n > self.node_size

    def link(self, spans_nodes: bool) -> tuple[float, float]:
        """Seconds per ring hop and bytes/s per rank of a group within a node, or spanning
        nodes."""
        if spans_nodes and self.node_size is not None:
            return float(self.inter_node_alpha_s or 0.0), float(self.inter_node_Bps or 1.0)
        return self.alpha_s, self.bandwidth_Bps

    def __post_init__(self) -> None:
        for field in ("bandwidth_Bps", "peak_flops", "mem_bandwidth_Bps"):
            if not getattr(self, field) > 0:
                raise GraphshardValueError(
                    f"HardwareProfile {self.name!r}: {field} must be positive"
                )
        if self.alpha_s < 0:
            raise GraphshardValueError(f"HardwareProfile {self.name!r}: alpha_s must be >= 0")
        if self.host_link_Bps is not None and not self.host_link_Bps > 0:
            raise GraphshardValueError(
                f"HardwareProfile {self.name!r}: host_link_Bps must be positive or None")
        if self.node_size is not None and not (
                self.node_size >= 1 and (self.inter_node_Bps or 0) > 0
                and (self.inter_node_alpha_s or 0) >= 0
                and self.inter_node_alpha_s is not None):
            raise GraphshardValueError(
                f"HardwareProfile {self.name!r}: with node_size, node_size must be >= 1, "
                f"inter_node_Bps positive and inter_node_alpha_s >= 0")


PROFILES: dict[str, HardwareProfile] = {
    # Intra-node NVLink 4: 18 links x 50 GB/s = 900 GB/s bidirectional, 450 GB/s per
    # direction (NVIDIA H100 Tensor Core GPU datasheet / Hopper architecture whitepaper).
    # 989 TFLOP/s dense BF16 tensor core, 3.35 TB/s HBM3 (H100 SXM5 datasheet).
    # 3 us per ring hop is a typical NCCL small-message step latency within one node.
    "h100-nvlink": HardwareProfile(
        name="h100-nvlink",
        alpha_s=3e-6,
        bandwidth_Bps=450e9,
        peak_flops=989e12,
        mem_bandwidth_Bps=3.35e12,
        source=(
            "NVIDIA H100 SXM5 datasheet: NVLink 4 900 GB/s bidirectional (450 GB/s per "
            "direction), dense BF16 989 TFLOP/s, HBM3 3.35 TB/s; alpha assumed 3 us/hop; "
            "host link PCIe 5.0 x16, 64 GB/s per direction, 40 GB/s as measured for "
            "graphshard's offload copies (docs/cpu-offload.md)"
        ),
        host_link_Bps=40e9,
    ),
    # Inter-node: one ConnectX-7 InfiniBand NDR 400 Gb/s port per GPU = 50 GB/s per rank
    # (NVIDIA DGX H100 user guide). Same GPU figures as above; ~5 us per hop across nodes.
    "h100-infiniband": HardwareProfile(
        name="h100-infiniband",
        alpha_s=5e-6,
        bandwidth_Bps=50e9,
        peak_flops=989e12,
        mem_bandwidth_Bps=3.35e12,
        source=(
            "NVIDIA DGX H100: one InfiniBand NDR 400 Gb/s (50 GB/s) port per GPU; H100 SXM5 "
            "datasheet: dense BF16 989 TFLOP/s, HBM3 3.35 TB/s; alpha assumed 5 us/hop; "
            "host link as h100-nvlink's"
        ),
        host_link_Bps=40e9,
    ),
    # Nodes of 8 H100s (DGX H100): NVLink within a node, one InfiniBand NDR port per GPU
    # between nodes; a group priced by where its ranks are.
    "h100-cluster": HardwareProfile(
        name="h100-cluster",
        alpha_s=3e-6,
        bandwidth_Bps=450e9,
        peak_flops=989e12,
        mem_bandwidth_Bps=3.35e12,
        source=(
            "DGX H100 nodes of 8 GPUs: within a node h100-nvlink's links, between nodes "
            "h100-infiniband's (50 GB/s per GPU, alpha 5 us/hop); the same GPU figures"
        ),
        host_link_Bps=40e9,
        node_size=8,
        inter_node_alpha_s=5e-6,
        inter_node_Bps=50e9,
    ),
    # Loopback gloo on a 2-core CPU box: fp32 matmul measured around 100 GFLOP/s with 2
    # threads, halved here; TCP loopback and copy bandwidth of a few GB/s, rounded down.
    "cpu-gloo": HardwareProfile(
        name="cpu-gloo",
        alpha_s=50e-6,
        bandwidth_Bps=1e9,
        peak_flops=50e9,
        mem_bandwidth_Bps=5e9,
        source="conservative defaults for gloo over loopback TCP on a small CPU machine",
    ),
}


def profile_dir() -> Path:
    """Where calibrated profiles live: ``$GRAPHSHARD_PROFILE_DIR`` or the user cache."""
    env = os.environ.get("GRAPHSHARD_PROFILE_DIR")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/graphshard/profiles").expanduser()


def get_profile(name: str) -> HardwareProfile:
    """The profile called ``name``: a calibrated JSON file if there is one, else the builtin.

    A calibrated file may give only some fields; the rest come from the builtin profile.
    """
    path = profile_dir() / f"{name}.json"
    builtin = PROFILES.get(name)
    if path.is_file():
        data = json.loads(path.read_text())
        data["name"] = name
        data.setdefault("source", f"calibrated: {path}")
        try:
            if builtin is not None:
                return dataclasses.replace(builtin, **data)
            return HardwareProfile(**data)
        except TypeError as e:
            raise GraphshardValueError(
                f"calibrated profile {path} is incomplete or malformed: {e}"
            ) from e
    if builtin is None:
        calibrated = sorted(p.stem for p in profile_dir().glob("*.json"))
        known = ", ".join(sorted(set(PROFILES) | set(calibrated)))
        raise GraphshardValueError(f"unknown hardware profile {name!r}; known profiles: {known}")
    return builtin


def save_profile(profile: HardwareProfile, path: str | os.PathLike | None = None) -> Path:
    """Write ``profile`` as JSON (default: the calibrated-profile directory); return the path."""
    target = Path(path) if path is not None else profile_dir() / f"{profile.name}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(dataclasses.asdict(profile), indent=2) + "\n")
    return target


# --- α-β ring collectives --------------------------------------------------------------------


def all_gather_time(total_bytes: float, n: int, profile: HardwareProfile,
                    spans_nodes: bool | None = None) -> float:
    """Ring all-gather producing ``total_bytes`` (the full output) on ``n`` ranks, over the
    links within a node or between nodes (``spans_nodes``; None: as
    :meth:`HardwareProfile.spans_nodes` guesses from ``n``)."""
    if n <= 1:
        return 0.0
    alpha, bandwidth = profile.link(profile.spans_nodes(n) if spans_nodes is None
                                    else spans_nodes)
    return alpha * (n - 1) + (n - 1) / n * total_bytes / bandwidth


def reduce_scatter_time(total_bytes: float, n: int, profile: HardwareProfile,
                        spans_nodes: bool | None = None) -> float:
    """Ring reduce-scatter of a ``total_bytes`` (full) input on ``n`` ranks."""
    return all_gather_time(total_bytes, n, profile, spans_nodes)


def all_reduce_time(total_bytes: float, n: int, profile: HardwareProfile,
                    spans_nodes: bool | None = None) -> float:
    """Ring all-reduce: a reduce-scatter followed by an all-gather of ``total_bytes``."""
    return 2 * all_gather_time(total_bytes, n, profile, spans_nodes)


def all_to_all_time(total_bytes: float, n: int, profile: HardwareProfile,
                    spans_nodes: bool | None = None) -> float:
    """All-to-all of a ``total_bytes`` input on ``n`` ranks: each rank keeps 1/n of it and
    sends the rest, priced like a ring all-gather of the same bytes."""
    return all_gather_time(total_bytes, n, profile, spans_nodes)


# --- node costs ------------------------------------------------------------------------------

_COLLECTIVES = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.all_gather_into_tensor_coalesced.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.reduce_scatter_tensor_coalesced.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
    c10d.all_to_all_single.default: "all_to_all",
    # An all-gather the optimizer step may have issued early (``step_prefetch``): priced as
    # the all-gather it stands for, at its place in the forward.
    TAKE_PREFETCHED: "all_gather",
    # gloo's all-gather (``graphshard.passes.gloo_gathers``): the same collective.
    ALL_GATHER_SINGLE: "all_gather",
}

# Ops that only alias their input (or are bookkeeping) and move no bytes.
_FREE_OPS = {
    operator.getitem,
    c10d.wait_tensor.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh.default,
}


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _names_node(
    fn: Callable[Concatenate[fx.Node, _P], _R],
) -> Callable[Concatenate[fx.Node, _P], _R]:
    """Prefix an :class:`UnpricedSizeError` raised while pricing a node with that node."""

    @functools.wraps(fn)
    def wrapper(node: fx.Node, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(node, *args, **kwargs)
        except UnpricedSizeError as e:
            if e.node is not None:  # already named (a nested pricing function)
                raise
            error = UnpricedSizeError(f"{node.format_node()}: {e}")
            error.node = node
            raise error from e

    return wrapper


def collective_kind(node: fx.Node) -> str | None:
    """``"all_gather"``, ``"reduce_scatter"``, ``"all_reduce"`` or ``"all_to_all"`` for a
    collective start."""
    if node.op != "call_function":
        return None
    return _COLLECTIVES.get(node.target)


def collective_group(node: fx.Node) -> tuple[str, int | None]:
    """The group name and group size of collective ``node``.

    All-gathers and reduce-scatters carry their size as an argument. An all-reduce or an
    all-to-all does not: its size is the lowering's ``graphshard`` tag ``group_size`` (HSDP's
    replica reduction) or ``node.meta["group_size"]``, which the graphshard backend records
    for the collectives that reach it from elsewhere (DTensor's tensor parallelism); None
    when neither is there.
    """
    kind = collective_kind(node)
    if kind is None:
        raise GraphshardValueError(f"{node.format_node()} is not a collective")
    group = node.args[-1]
    name = group if isinstance(group, str) else getattr(group, "group_name", str(group))
    if kind == "all_gather":
        return name, int(node.args[1])
    if kind == "reduce_scatter":
        return name, int(node.args[2])
    size = node.meta.get("graphshard", {}).get("group_size", node.meta.get("group_size"))
    return name, None if size is None else int(size)


GROUP_RANKS = "graphshard_group_ranks"  # gm.meta: {group name: its global ranks}


def collective_ranks(node: fx.Node) -> tuple[int, ...] | None:
    """The global ranks of collective ``node``'s group, where the graph records them
    (``gm.meta[GROUP_RANKS]``, written by the graphshard backend, which knows the groups;
    the passes never look at a process group)."""
    owner = node.graph.owning_module
    known = owner.meta.get(GROUP_RANKS) if owner is not None else None
    return None if not known else known.get(collective_group(node)[0])


@_names_node
def collective_bytes_per_rank(node: fx.Node, world_size: int | None = None) -> float:
    """Bytes one rank sends for collective ``node`` on a ring of ``n`` ranks.

    All-gather: (n-1)/n of the full (gathered) output; reduce-scatter: (n-1)/n of the full
    input; all-reduce (a reduce-scatter then an all-gather): 2(n-1)/n of the tensor;
    all-to-all: the (n-1)/n of its input that goes to the other ranks (even splits
    assumed). ``world_size`` is
    used where the node does not say its group size (see :func:`collective_group`).
    """
    kind = collective_kind(node)
    _, n = collective_group(node)
    n = n if n is not None else world_size
    if n is None:
        raise GraphshardValueError(f"{node.name}: {kind} needs its group size to be costed")
    if n <= 1:
        return 0.0
    if kind == "all_gather":
        full = tensor_bytes(node.meta["val"])
    else:
        full = input_bytes(node)
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n * full


def input_bytes(node: fx.Node) -> int:
    """Bytes of a collective's input: its first argument, or for a coalesced collective the
    list of tensors that is its first argument."""
    inputs = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    return sum(tensor_bytes(i.meta["val"]) for i in inputs)


def _int(x: Any) -> int:
    """A concrete int from an int or a SymInt (its hint when it is symbolic).

    ``int()`` on a SymInt would install a guard and specialise the dynamic dimension: a graph
    compiled for a new batch size would then recompile for every other one. The hint prices
    the shape that was traced without constraining the graph.
    """
    if isinstance(x, torch.SymInt):
        hint = getattr(x.node, "hint", None)  # every backed size (and size expression) has one
        if hint is None:  # an unbacked (data-dependent) size: pricing it 0 would lie
            raise UnpricedSizeError(
                f"the symbolic size {x} has no hint (it is data-dependent), so the cost model "
                "cannot price it"
            )
        return int(hint)
    return int(x)



def _tensors(val: Any) -> Iterator[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        yield val
    elif isinstance(val, (list, tuple)):
        for v in val:
            yield from _tensors(v)


def tensor_bytes(val: Any) -> int:
    """Bytes of a tensor, or of all tensors in a (nested) tuple/list; 0 for anything else."""
    return sum(_int(t.numel()) * t.element_size() for t in _tensors(val))


def _shape(node: Any) -> list[int]:
    return [_int(s) for s in node.meta["val"].shape]


def _conv_flops(x: list[int], w: list[int], out: list[int], transposed: bool) -> int:
    # Each output element (each input element for a transposed conv) takes one multiply-add
    # per weight entry of one output channel: weight.numel() / weight.shape[0].
    per_elem = math.prod(w[1:])
    return 2 * math.prod(x if transposed else out) * per_elem


def _sdpa_flops(q: list[int], k: list[int], v: list[int]) -> int:
    *batch, s_q, d = q
    s_k, d_v = k[-2], v[-1]
    return 2 * math.prod(batch) * s_q * s_k * (d + d_v)  # QK^T and PV


def _region_nodes(node: fx.Node) -> list[fx.Node] | None:
    """The nodes a block region's call (``invoke_subgraph``) runs; None for other nodes."""
    return list(region_body(node).graph.nodes) if is_region_call(node) else None


@_names_node
def node_flops(node: fx.Node) -> int:
    """FLOPs of matmul-like ``node`` (a multiply-add counts 2), or of every node a block
    region's call runs; 0 for other ops."""
    body = _region_nodes(node)
    if body is not None:
        return sum(node_flops(n) for n in body)
    if node.op != "call_function" or "val" not in node.meta:
        return 0
    target, args = node.target, node.args
    if target is aten.mm.default:
        (m, k), n = _shape(args[0]), _shape(args[1])[1]
        return 2 * m * n * k
    if target is aten.addmm.default:  # the bias add is not counted
        (m, k), n = _shape(args[1]), _shape(args[2])[1]
        return 2 * m * n * k
    if target in (aten.bmm.default, aten.baddbmm.default):
        a, b = (args[0], args[1]) if target is aten.bmm.default else (args[1], args[2])
        (batch, m, k), n = _shape(a), _shape(b)[2]
        return 2 * batch * m * n * k
    if target is aten.convolution.default:
        return _conv_flops(_shape(args[0]), _shape(args[1]), _shape(node), bool(args[6]))
    if target is aten.convolution_backward.default:
        grad_out, x, w = (_shape(a) for a in args[:3])
        mask = args[10]
        # grad_input and grad_weight each cost one forward convolution.
        return _conv_flops(x, w, grad_out, bool(args[7])) * (int(mask[0]) + int(mask[1]))
    name = getattr(target, "__name__", "")
    if "_scaled_dot_product" in name and "attention" in name:
        if "backward" in name:  # dQ, dK, dV and dP: twice the forward matmuls
            return 2 * _sdpa_flops(*(_shape(a) for a in args[1:4]))
        return _sdpa_flops(*(_shape(a) for a in args[:3]))
    return 0


def _is_free(node: fx.Node) -> bool:
    if node.op != "call_function":
        return True
    return node.target in _FREE_OPS or bool(getattr(node.target, "is_view", False))


@_names_node
def node_time(node: fx.Node, profile: HardwareProfile, *, world_size: int | None = None) -> float:
    """Seconds ``node`` takes on ``profile``: comm time, FLOPs / peak, or bytes / memory bw.

    ``world_size`` is the group size of ``all_reduce`` and ``all_to_all`` nodes whose
    arguments and tags do not say it (see :func:`collective_group`).
    """
    kind = collective_kind(node)
    if kind is not None:
        # An all-reduce the lowering made (HSDP's replica reduction) records its group size;
        # the backend records the size of DTensor's (tensor parallel) ones.
        size = collective_group(node)[1] or world_size
        if size is None:
            raise GraphshardValueError(f"{node.name}: {kind} needs world_size to be costed")
        spans = profile.spans_nodes(size, collective_ranks(node))
        if kind == "all_gather":
            return all_gather_time(tensor_bytes(node.meta["val"]), size, profile, spans)
        if kind == "reduce_scatter":
            return reduce_scatter_time(input_bytes(node), size, profile, spans)
        if kind == "all_to_all":
            return all_to_all_time(tensor_bytes(node.args[0].meta["val"]), size, profile,
                                   spans)
        return all_reduce_time(tensor_bytes(node.meta["val"]), size, profile, spans)
    body = _region_nodes(node)
    if body is not None:  # a block region: what its body's nodes take
        return sum(node_time(n, profile, world_size=world_size) for n in body)
    if _is_free(node):
        return 0.0
    flops = node_flops(node)
    if flops:
        return flops / profile.peak_flops
    out = tensor_bytes(node.meta.get("val"))
    if out == 0:
        return 0.0
    inputs: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), inputs.append)
    moved = out + sum(tensor_bytes(a.meta.get("val")) for a in inputs)
    return moved / profile.mem_bandwidth_Bps
