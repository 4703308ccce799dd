"""The root of graphshard's error family, and the errors the graph passes raise.

Every error graphshard raises on purpose derives from :class:`GraphshardError`, so
``except graphshard.GraphshardError`` catches them all. Each also keeps the builtin base it
had before (``ValueError``, ``RuntimeError``, ...), so ``except ValueError`` code keeps
working.

Why this module lives in ``passes``: imports point ``graphshard -> passes`` and never back
(the passes run offline, without the runtime package). The passes raise these errors too,
so the root of the family must sit where both can import it: here, a leaf module that
imports nothing of either package. ``graphshard.errors`` re-exports everything defined here
and adds the errors only the runtime raises; users import from ``graphshard``.
"""

from __future__ import annotations

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
]


class GraphshardError(Exception):
    """The base of every error graphshard raises on purpose."""


class GraphshardValueError(GraphshardError, ValueError):
    """A value graphshard was given (an option, a config, a shape) is not acceptable."""


class GraphshardTypeError(GraphshardError, TypeError):
    """Graphshard was given an object of a type it does not support."""


class GraphshardRuntimeError(GraphshardError, RuntimeError):
    """An operation cannot go on in the current state (of the process group, a checkpoint)."""


class GraphshardNotImplementedError(GraphshardError, NotImplementedError):
    """A combination of features graphshard does not support (yet)."""


class GraphshardKeyError(GraphshardError, KeyError):
    """A name (a preset, a profile) graphshard does not know."""


class GraphshardFileNotFoundError(GraphshardError, FileNotFoundError):
    """A file or directory graphshard was pointed at does not exist."""


class GraphLoweringError(GraphshardError, RuntimeError):
    """A graph pass met a graph it cannot lower as planned (the message says what to do)."""


class UnpricedSizeError(GraphshardError, ValueError):
    """The cost model met a symbolic size with no hint (a data-dependent, unbacked size).

    ``node`` is the FX node being priced, once known (the message then starts with it).
    """

    node: object | None = None
