"""What graphshard's handlers in DTensor's dispatcher share.

graphshard registers handlers for a few ops with DTensor's dispatcher
(``DTensor._op_dispatcher._custom_op_handlers``): random initialisation of sharded
parameters (:mod:`graphshard.api.random_init`) and the fused optimizers' step
(:mod:`graphshard.api.fused_optimizer_ops`). Each serves the calls it can and hands the
others back to DTensor's own dispatch with :func:`through_dtensor`.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.tensor import DTensor

__all__ = ["through_dtensor"]


def through_dtensor(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op(*args, **kwargs)`` through DTensor's own dispatch: the handler registered for
    ``op`` stands aside for this one call."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = handler
