"""What graphshard's handlers in DTensor's dispatcher share.

graphshard registers handlers for a few ops with DTensor's dispatcher
(``DTensor._op_dispatcher._custom_op_handlers``): random initialisation of sharded
parameters (:mod:`graphshard.api.random_init`), the fused optimizers' step
(:mod:`graphshard.api.fused_optimizer_ops`) and the ops of ``clip_grad_norm_``
(:mod:`graphshard.api.grad_norm_ops`). Each serves the calls it can and hands the others back
to DTensor's own dispatch with :func:`through_dtensor`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["handlers_aside", "same_mesh", "through_dtensor", "wrap_local"]


def same_mesh(mesh: Any, other: Any) -> bool:
    """The same mesh, or an equal one (same ranks, dimensions and device type): each rank's
    pieces are the same slices on either. Identity alone is not enough: DTensor's sharding
    cache can give an op's output the spec, and so the mesh object, of an earlier equal
    call."""
    return mesh is other or mesh == other


def through_dtensor(op: Any, args: tuple, kwargs: dict) -> Any:
    """``op(*args, **kwargs)`` through DTensor's own dispatch: the handler registered for
    ``op`` stands aside for this one call."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handler = handlers.pop(op)
    try:
        return op(*args, **kwargs)
    finally:
        handlers[op] = handler


@contextlib.contextmanager
def handlers_aside(*handlers: Callable[..., Any]) -> Iterator[None]:
    """Within, every op one of ``handlers`` is registered for goes through DTensor's own
    dispatch again (what it costs, and computes, without graphshard's path: the
    benchmark's and the tests' reference)."""
    table = DTensor._op_dispatcher._custom_op_handlers
    ours = {op: handler for op, handler in table.items() if handler in handlers}
    for op in ours:
        del table[op]
    try:
        yield
    finally:
        table.update(ours)


# DTensor's constructor where it is the C++ one (torch 2.11 to 2.14.1): called as
# ``DTensor(...)`` it also runs ``DTensor.__init__``, which does nothing but costs three
# Python wrappers (Dynamo's and export's), about 2.8 us a call here: 0.4 ms a step at 147
# parameters. Were a release to make it Python again, the class itself.
_CPP_NEW = getattr(torch.Tensor, "_dtensor__new__", None)
_DTENSOR_NEW = _CPP_NEW if _CPP_NEW is not None and DTensor.__new__ is _CPP_NEW else None


def wrap_local(local: torch.Tensor, spec: Any) -> DTensor:
    """A DTensor around ``local`` on ``spec``, not requiring grad: what ``DTensor(local, spec,
    requires_grad=False)`` makes (a gradient, an op's result inside DTensor's dispatch),
    without its no-op ``__init__``."""
    if _DTENSOR_NEW is None:
        return DTensor(local, spec, requires_grad=False)
    return _DTENSOR_NEW(DTensor, local, spec, requires_grad=False)
