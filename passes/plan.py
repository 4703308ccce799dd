"""``Plan`` (the options every pass reads) and ``Bucket`` (markers lowered as one collective)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from graphshard.passes.cost_model import HardwareProfile, get_profile
from graphshard.passes.errors import GraphshardValueError
from graphshard.passes.markers import marker_args

__all__ = ["Plan", "Bucket", "collect_buckets", "use_all_to_all", "ALL_TO_ALL_BACKENDS"]


BUCKETING = ("block", "size", "auto")
REDUCE_SCATTER_VIA = ("auto", "reduce_scatter", "all_to_all")
# Process-group backends whose reduce-scatter is an all-reduce of the whole input (gloo's).
ALL_TO_ALL_BACKENDS = frozenset({"gloo"})


def use_all_to_all(via: str, backend: str | None) -> bool:
    """Whether a reduce-scatter asked for ``via`` (a ``Plan.reduce_scatter_via``) on a group
    of ``backend`` (None: unknown, e.g. offline) runs as an all-to-all plus a sum."""
    return via == "all_to_all" or (via == "auto" and backend in ALL_TO_ALL_BACKENDS)


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
        split_last_reduce: reduce the gradients of the backward's last buckets that are
            ready early (a root bucket's output layer, a first block's feed-forward) in a
            reduce-scatter of their own, issued when they are ready, where the cost model
            predicts it shortens the exposed end of the backward
            (:mod:`graphshard.passes.split_reduce`).
        reduce_scatter_via: how a bucket's gradients are reduce-scattered. ``"reduce_scatter"``:
            the collective. ``"all_to_all"``: each rank sends every other rank that rank's
            piece (an all-to-all) and sums the pieces it receives, the same result with half
            the bytes on the wire where the backend's reduce-scatter is an all-reduce of the
            whole buffer (gloo's is: it clones the input, all-reduces it and keeps one chunk).
            ``"auto"`` (default): ``"all_to_all"`` on gloo groups, the collective elsewhere
            (the backend reads each group's backend before the passes run; offline, with no
            process group, it is the collective).
    """

    prefetch_depth: int = 1
    max_unsharded_bytes: int | None = None
    bucketing: str = "block"
    bucket_bytes: int = 25 * 2**20
    profile: str | HardwareProfile = "cpu-gloo"
    reshard_last_bucket: bool = False
    step_prefetch: bool = False
    split_last_reduce: bool = True
    reduce_scatter_via: str = "auto"

    def __post_init__(self) -> None:
        if self.bucketing not in BUCKETING:
            raise GraphshardValueError(
                f"bucketing must be one of {BUCKETING}, got {self.bucketing!r}"
            )
        if self.reduce_scatter_via not in REDUCE_SCATTER_VIA:
            raise GraphshardValueError(
                f"reduce_scatter_via must be one of {REDUCE_SCATTER_VIA}, got "
                f"{self.reduce_scatter_via!r}"
            )
        if self.prefetch_depth < 0:
            raise GraphshardValueError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")
        if self.bucket_bytes <= 0:
            raise GraphshardValueError(f"bucket_bytes must be positive, got {self.bucket_bytes}")
        if isinstance(self.profile, str):
            object.__setattr__(self, "profile", get_profile(self.profile))


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
