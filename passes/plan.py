"""``Plan`` (the options every pass reads) and ``Bucket`` (markers lowered as one collective)."""

from __future__ import annotations

import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from graphshard.passes.cost_model import HardwareProfile, get_profile
from graphshard.passes.errors import GraphshardTypeError, GraphshardValueError
from graphshard.passes.markers import marker_args

__all__ = [
    "Plan", "Bucket", "collect_buckets", "use_all_to_all", "parse_bytes", "ALL_TO_ALL_BACKENDS",
]


BUCKETING = ("block", "size", "auto")
REDUCE_SCATTER_VIA = ("auto", "reduce_scatter", "all_to_all", "coalesced")
ALL_GATHER_VIA = ("flat", "coalesced")
# Process-group backends whose reduce-scatter is an all-reduce of the whole input (gloo's).
ALL_TO_ALL_BACKENDS = frozenset({"gloo"})


def use_all_to_all(via: str, backend: str | None) -> bool:
    """Whether a reduce-scatter asked for ``via`` (a ``Plan.reduce_scatter_via``) on a group
    of ``backend`` (None: unknown, e.g. offline) runs as an all-to-all plus a sum."""
    return via == "all_to_all" or (via == "auto" and backend in ALL_TO_ALL_BACKENDS)


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: object, option: str = "memory_budget") -> int:
    """A byte count from an int or a string such as ``"40GiB"``, ``"512 MiB"``, ``"1.5e9"``,
    ``"80GB"`` (KiB/MiB/GiB/TiB: powers of 1024; KB/MB/GB/TB: of 1000; case-insensitive).

    Raises ``GraphshardTypeError`` (not an int or str) or ``GraphshardValueError`` (not a
    positive size), naming ``option``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise GraphshardTypeError(
            f"graphshard backend option {option} must be a byte count (an int such as "
            f"40 * 2**30, or a str such as '40GiB') or None, got {value!r} "
            f"({type(value).__name__})"
        )
    if isinstance(value, int):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = match and match.group(2).lower()
        if match is None or unit not in _UNITS:
            raise GraphshardValueError(
                f"graphshard backend option {option} must be a size such as '40GiB', "
                f"'512MiB' or '80GB' (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), got {value!r}"
            )
        number = int(float(match.group(1)) * _UNITS[unit])
    if number < 1:
        raise GraphshardValueError(
            f"graphshard backend option {option} must be positive (bytes of memory per rank), "
            f"got {value!r}"
        )
    return int(number)


@dataclass(frozen=True)
class Plan:
    """Options that steer the passes. Identical on every rank, so the schedule is too.

    Attributes:
        prefetch_depth: buckets gathered ahead of the one computing (0 = gather on use).
        max_unsharded_bytes: cap on gathered bytes alive at once (None = no cap); prefetch
            is shortened and ``auto`` buckets are sized to respect it.
        bucketing: ``"block"`` keeps the buckets ``shard()`` chose from module structure;
            ``"size"`` packs parameters in execution order up to ``bucket_bytes``;
            ``"auto"`` picks boundaries with the cost model. Buckets the user named in
            ``shard(buckets=[...])`` are kept by every strategy.
        bucket_bytes: the byte cap of the ``"size"`` strategy.
        profile: the hardware profile the ``"auto"`` strategy's cost model uses: a
            :class:`HardwareProfile` or its name, resolved here (a calibrated file on disk is
            read once, when the plan is made, never inside a pass).
        reshard_last_bucket: also free the bucket of the parameter read last in forward. By
            default it is kept for backward, which starts by needing it (as FSDP2 keeps its
            root).
        step_prefetch: let the optimizer step gather the buckets the next forward starts
            with (the gathers it issues before its first wait), as soon as their parameters
            are updated, so they are not exposed at the start of the step
            (:mod:`graphshard.passes.step_prefetch`). The forward checks on every rank that
            the gathered shards are unchanged and gathers again otherwise, so results are the
            same with or without it. Off by default: on the CPU it saves nothing measurable
            (the rest of the optimizer step is too short to hide the gathers), it costs one
            small all-reduce per forward (on a GPU also a host synchronisation), and it has
            not been measured on a GPU.
        break_prefetch: across a graph break, let the end of a compiled forward gather
            the buckets the next forward graph starts with (the gathers it issues before its
            first wait), so they run under the eager code between the two graphs instead of
            being exposed at the second one's start
            (:mod:`graphshard.api.break_prefetch`). The graph taking them checks this rank's
            shards unchanged since (by their version counters, no collective and no host
            synchronisation). Forward only: the backward's graphs still start with their own
            gathers. Off by default: not measured on a GPU.
        split_last_reduce: reduce the gradients of the backward's last buckets that are
            ready early (a root bucket's output layer, a first block's feed-forward) in a
            reduce-scatter of their own, issued when they are ready, where the cost model
            predicts it shortens the exposed end of the backward
            (:mod:`graphshard.passes.split_reduce`).
        memory_budget: bytes of memory per rank (an int, or a str such as ``"40GiB"``,
            stored as the int) that ``shard(reshard_after_forward="auto")`` must fit: per
            bucket, the compiler keeps the gathered parameters for backward (ZeRO-2) or frees
            them and gathers again (ZeRO-3), and may shorten the prefetch depth, choosing the
            fastest schedule the cost model predicts whose predicted peak (sharded state,
            gradients, AdamW's two optimizer states, saved activations, gathered buckets)
            fits (:mod:`graphshard.passes.auto_reshard`). None: the CUDA device's memory on
            a GPU, no budget on the CPU (everything kept). Ignored unless some parameter is
            sharded with ``reshard_after_forward="auto"``.
        reduce_scatter_via: how a bucket's gradients are reduce-scattered. ``"reduce_scatter"``:
            the collective. ``"all_to_all"``: each rank sends every other rank that rank's
            piece (an all-to-all) and sums the pieces it receives, the same result with half
            the bytes on the wire where the backend's reduce-scatter is an all-reduce of the
            whole buffer (gloo's is: it clones the input, all-reduces it and keeps one chunk).
            ``"auto"`` (default): ``"all_to_all"`` on gloo groups, the collective elsewhere
            (the backend reads each group's backend before the passes run; offline, with no
            process group, it is the collective). ``"coalesced"``: one coalesced
            reduce-scatter (``reduce_scatter_tensor_coalesced``) takes every gradient where
            it lives (a contiguous gradient, rank-major already, is not copied; one that
            needs padding is) and hands each parameter its own reduced shard, so neither the
            copy into a flat buffer nor a cut out of it is made; a bucket that adds held-back
            partials, all-reduces across replicas (HSDP), casts back or offloads its
            gradients keeps the flat collective.
        all_gather_via: how a bucket of several parameters is gathered. ``"flat"``
            (default): its shards, in one buffer (the bucket's storage, or a copy where
            ``gather_from_storage`` cannot read it), are gathered in one all-gather, and each
            parameter is copied out of the rank-major result. ``"coalesced"``: one
            coalesced all-gather (``all_gather_into_tensor_coalesced``, still one collective
            call) takes every shard where it lives and writes every parameter whole, so
            neither copy is made (a shard that needs padding or a cast still gets its own
            copy); the backend runs the pieces as one group (NCCL) or packs them itself
            (gloo). With ``step_prefetch`` every bucket stays flat (the optimizer step
            gathers flat buffers).
        gather_from_storage: a flat gather reads its bucket's shards where ``shard()`` laid
            them out, in one flat padded buffer per bucket, instead of copying them into one
            (:mod:`graphshard.passes.bucket_storage`). On by default; False copies every
            bucket's shards into its gather buffer at every gather, as before this storage
            existed (for comparison).
        grad_copy_stream: under CPU offload, copy the backward's gradients to the host on a
            copy stream of their own, waiting once per graph, where False copies each
            bucket's on the compute stream and waits for it
            (:mod:`graphshard.passes.grad_copy_stream`). On by default (with
            ``shard_copy_stream``, the compiled offload step took 0.84x FSDP2's on an H200,
            where both off took 1.19x on an H100); nothing changes on the CPU. False: every
            gradient copy on the compute stream, waited for.
        shard_copy_stream: under CPU offload, copy each bucket's shards to the device on a
            copy stream of their own, issued one bucket ahead and waited for where the copy
            was, where False copies them on the compute stream just before their
            gather (:mod:`graphshard.passes.shard_copy_stream`). On by default (see
            ``grad_copy_stream``); nothing changes on the CPU.

    Every option is checked when the plan is made (so at ``graphshard.backend(...)``, not at
    the first compile): a wrong type raises ``GraphshardTypeError`` and a value out of range
    ``GraphshardValueError``, each naming the option, the value and what is allowed.
    """

    prefetch_depth: int = 1
    max_unsharded_bytes: int | None = None
    bucketing: str = "block"
    bucket_bytes: int = 25 * 2**20
    profile: str | HardwareProfile = "cpu-gloo"
    reshard_last_bucket: bool = False
    step_prefetch: bool = False
    break_prefetch: bool = False
    split_last_reduce: bool = True
    reduce_scatter_via: str = "auto"
    memory_budget: int | str | None = None
    all_gather_via: str = "flat"
    gather_from_storage: bool = True
    grad_copy_stream: bool = True
    shard_copy_stream: bool = True

    def __post_init__(self) -> None:
        _check_int("prefetch_depth", self.prefetch_depth, 0, self,
                   "buckets gathered ahead of the one computing, 0 to gather on use")
        if self.max_unsharded_bytes is not None:
            _check_int("max_unsharded_bytes", self.max_unsharded_bytes, 1, self,
                       "a byte count such as 2 * 2**30, or None for no cap")
        _check_choice("bucketing", self.bucketing, BUCKETING)
        _check_int("bucket_bytes", self.bucket_bytes, 1, self, "a byte count such as 25 * 2**20")
        for name in ("reshard_last_bucket", "step_prefetch", "break_prefetch", "split_last_reduce",
                     "gather_from_storage", "grad_copy_stream", "shard_copy_stream"):
            _check_bool(name, getattr(self, name))
        _check_choice("reduce_scatter_via", self.reduce_scatter_via, REDUCE_SCATTER_VIA)
        _check_choice("all_gather_via", self.all_gather_via, ALL_GATHER_VIA)
        if self.memory_budget is not None:
            value = self.memory_budget
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                value = int(value)
            object.__setattr__(self, "memory_budget", parse_bytes(value, "memory_budget"))
        if isinstance(self.profile, str):
            object.__setattr__(self, "profile", get_profile(self.profile))
        elif not isinstance(self.profile, HardwareProfile):
            raise GraphshardTypeError(
                f"graphshard backend option profile must be a hardware profile's name (a str "
                f"such as 'cpu-gloo' or 'h100-nvlink') or a HardwareProfile, got "
                f"{self.profile!r} ({type(self.profile).__name__})"
            )


def _check_int(name: str, value: object, minimum: int, plan: Plan, what: str) -> None:
    """Refuse a non-integer (a bool, a float, a str) or one below ``minimum``; store an
    integer-like value (a NumPy integer) as a plain ``int``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise GraphshardTypeError(
            f"graphshard backend option {name} must be an int ({what}); got {value!r} "
            f"({type(value).__name__})"
        )
    if value < minimum:
        bound = ">= 0" if minimum == 0 else "positive"
        raise GraphshardValueError(
            f"graphshard backend option {name} must be {bound} ({what}); got {value}"
        )
    object.__setattr__(plan, name, int(value))


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise GraphshardTypeError(
            f"graphshard backend option {name} must be True or False, got {value!r} "
            f"({type(value).__name__})"
        )


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        kind = GraphshardValueError if isinstance(value, str) else GraphshardTypeError
        raise kind(
            f"graphshard backend option {name} must be one of {choices}, got {value!r}"
        )


@dataclass
class Bucket:
    """The marker nodes of one bucket, in graph order; lowered into one collective."""

    index: int
    nodes: list[fx.Node] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        """Parameter names, in the order of the bucket's flat buffer."""
        return [marker_args(n).name for n in self.nodes]


def collect_buckets(graph: fx.Graph, is_marker: Callable[[fx.Node], bool]) -> list[Bucket]:
    """Group the marker nodes of ``graph`` by bucket, buckets in order of first appearance."""
    buckets: dict[int, Bucket] = {}
    for node in graph.nodes:
        if is_marker(node):
            index = marker_args(node).bucket
            buckets.setdefault(index, Bucket(index)).nodes.append(node)
    return list(buckets.values())
