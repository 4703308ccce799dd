"""Every error graphshard raises on purpose, all derived from :class:`GraphshardError`.

``except graphshard.GraphshardError`` catches any of them; each also keeps its builtin base
(``RuntimeError``, ``ValueError``, ...), so existing ``except RuntimeError`` code keeps
working. This is a leaf module: it imports nothing else of ``graphshard``.

The root of the family and the errors the graph passes raise are defined in
:mod:`graphshard.passes.errors` and re-exported here: imports point ``graphshard ->
graphshard.passes`` and never back, so that is the one place both packages can import them
from. The errors only the runtime raises are defined here; the modules that raise them
(``graphshard.safety.guards``, ``graphshard.safety.fingerprint``, ``graphshard.safety.failures``,
``graphshard.state.checkpoint``) re-export them.
"""

from __future__ import annotations

from graphshard.passes.errors import (
    GraphLoweringError,
    GraphshardError,
    GraphshardFileNotFoundError,
    GraphshardKeyError,
    GraphshardNotImplementedError,
    GraphshardRuntimeError,
    GraphshardTypeError,
    GraphshardValueError,
    UnpricedSizeError,
)

__all__ = [
    "GraphshardError",
    "GraphshardValueError",
    "GraphshardTypeError",
    "GraphshardRuntimeError",
    "GraphshardNotImplementedError",
    "GraphshardKeyError",
    "GraphshardFileNotFoundError",
    "GraphLoweringError",
    "UnpricedSizeError",
    "ShardedModelError",
    "PlanMismatchError",
    "RankFailureError",
    "CheckpointMismatchError",
]


class ShardedModelError(GraphshardError, RuntimeError):
    """An operation that would silently corrupt a sharded model."""


class PlanMismatchError(GraphshardError, RuntimeError):
    """Ranks would issue different collectives: the message names what differs."""


class RankFailureError(GraphshardError, RuntimeError):
    """Another rank failed (or stopped responding) while this rank was in a collective."""


class CheckpointMismatchError(GraphshardError, ValueError):
    """A checkpoint does not fit the model or optimizer it is loaded into (nothing was
    written to them): the message names every key that differs."""
