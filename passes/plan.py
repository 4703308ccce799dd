"""``Plan`` (the options every pass reads) and ``Bucket`` (markers lowered as one collective)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from passes.markers import marker_args

__all__ = ["Plan", "Bucket", "collect_buckets"]


@dataclass(frozen=True)
class Plan:
    """Options that steer the passes. Identical on every rank, so the schedule is too."""

    prefetch_depth: int = 1
    max_unsharded_bytes: int | None = None


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
