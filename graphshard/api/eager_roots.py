"""graphshard's eager bookkeeping runs eagerly when Dynamo would make it a frame of its own.

Under ``torch.compile`` Dynamo traces every Python frame that starts while a compiled
callable runs, also those that code running eagerly starts. Some of a model's code always
runs eagerly there:

- torch's ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN``, which Dynamo declines to trace
  ("Attempted to wrap RNN, GRU, or LSTM"), and the forward that calls one, which Dynamo
  then leaves to run eagerly ("Skipping the function and falling back to eager");
- any other frame Dynamo gives up on that way.

Such code reads its sharded parameters eagerly (``getattr(self, "weight_ih_l0")``), and
each read calls graphshard's ``__getattr__`` (:mod:`graphshard.api.param_reads`) as a new
frame. Traced there on its own, the read is a graph of one gather whose input is the
plain local shard, which the backend refuses as an unsharded parameter; and the check at
the end of the root's forward (:mod:`graphshard.safety.mutation`) would compare the
versions of fake tensors, not of the gathered copies, and report an in-place update that
never happened.

:func:`run_eagerly_as_root` marks such functions: a frame that starts at one runs without
Dynamo, with everything it calls, as it would outside ``torch.compile``. Dynamo still
inlines the function where traced code calls it (the marking is on the frame's code, which
only Dynamo's frame evaluation reads), so a traced forward's reads stay in its graph.

Such a step trains exactly, but the eager part gathers each parameter on its own, with no
overlap, and Dynamo says nothing by default. The first eager read inside a compiled call
warns once per module class (:class:`EagerForwardWarning`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

import torch._dynamo.config
from torch._C._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.types import FrameAction, FrameExecStrategy

__all__ = ["EagerForwardWarning", "note_eager_read_under_compile", "run_eagerly_as_root",
           "warn_once"]

Fn = TypeVar("Fn", bound=Callable)

# This frame and every frame it starts run without Dynamo.
_EAGER = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)


def run_eagerly_as_root(fn: Fn) -> Fn:
    """Mark ``fn`` so that Dynamo never starts a trace at it (module docstring); returns it.

    The mark is on ``fn.__code__``, shared by every closure made from one ``def``."""
    set_code_exec_strategy(fn.__code__, _EAGER)
    return fn


class EagerForwardWarning(UserWarning):
    """Part of a compiled model's forward ran eagerly: Dynamo left it out of every graph."""


_WARNED: set[str] = set()  # keys warned about (module classes, functional_call), once each


def warn_once(key: str, message: str, stacklevel: int = 2) -> None:
    """An :class:`EagerForwardWarning` with ``message``, once per ``key`` in a process."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, EagerForwardWarning, stacklevel=stacklevel + 1)


def note_eager_read_under_compile(module_class: str, param_name: str) -> None:
    """Warn (once per ``module_class``) that ``param_name`` was gathered eagerly inside a call
    of the model through ``torch.compile``."""
    if module_class in _WARNED:
        return
    if module_class not in ("LSTM", "GRU", "RNN"):
        hint = "TORCH_LOGS=graph_breaks shows why Dynamo gave up on it"
    elif not torch._dynamo.config.allow_rnn:
        hint = "set torch._dynamo.config.allow_rnn = True before compiling to trace it"
    else:  # torch 2.11's Dynamo re-reads the layer's weights after the graph, for _flat_weights
        hint = "with allow_rnn set, torch 2.13 and later trace it whole"
    warn_once(module_class,
              f"{module_class} read its parameter {param_name!r} eagerly inside a compiled call "
              "of the model: Dynamo ran that part of the forward without tracing it. It trains "
              "exactly, but each such parameter is gathered on its own, with no overlap, and "
              f"its gradient reduced the same way; {hint}.", stacklevel=3)
