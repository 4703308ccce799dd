"""``torch.compile(model, backend="graphshard", mode=..., options=...)``.

torch hands a backend named by a string its ``mode`` and ``options`` as keyword arguments.
graphshard reads them as a user porting ``torch.compile(model, mode="max-autotune")``
would expect:

- ``options`` are graphshard's backend options (what :func:`graphshard.backend` takes), as
  torch documents ``options`` for a backend other than Inductor;
- ``mode`` is Inductor's (:func:`torch._inductor.list_mode_options`), applied to every
  Inductor compile of the step, forward and backward, and seen by AOTAutograd's and
  Inductor's cache keys. CUDA graphs, which ``"reduce-overhead"`` and ``"max-autotune"``
  add, are not built: on a CUDA graph those modes raise and name the mode without them
  (``"max-autotune-no-cudagraphs"``); on a CPU graph Inductor builds none either, so the
  rest of the mode applies.

Before, either keyword failed at the first call with ``TypeError: _default_backend() got an
unexpected keyword argument``, naming nothing to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphshard.errors import GraphshardNotImplementedError, GraphshardValueError

__all__ = ["MODES", "inductor_config_for", "without_cuda_graphs"]

MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
_CUDA_GRAPHS = "triton.cudagraphs"


def inductor_config_for(mode: str | None, inductor: bool) -> dict[str, Any]:
    """Inductor's config settings for ``mode`` (empty for None and ``"default"``).

    Raises:
        GraphshardValueError: a mode torch.compile does not have, or a mode together with
            ``inductor=False`` (nothing is compiled then).
    """
    if mode is None or mode == "default":
        return {}
    if mode not in MODES:
        raise GraphshardValueError(
            f"Unknown torch.compile mode {mode!r} for the graphshard backend; the modes are "
            f"{', '.join(repr(m) for m in MODES)}")
    if not inductor:
        raise GraphshardValueError(
            f"torch.compile mode {mode!r} configures Inductor, and the graphshard backend "
            "option inductor=False compiles nothing: drop one of them")
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode))


def without_cuda_graphs(config: dict[str, Any], mode: str | None,
                        example_inputs: Sequence[Any]) -> dict[str, Any]:
    """``config`` less CUDA graphs, for a graph whose inputs are ``example_inputs``.

    Raises:
        GraphshardNotImplementedError: ``mode`` asks for CUDA graphs and the graph runs on
            a CUDA device.
    """
    if not config.get(_CUDA_GRAPHS):
        return config
    if any(isinstance(t, torch.Tensor) and t.device.type == "cuda" for t in example_inputs):
        raise GraphshardNotImplementedError(
            f"torch.compile mode {mode!r} records CUDA graphs, which the graphshard backend "
            "does not build around its collectives: use mode='max-autotune-no-cudagraphs' "
            "(Inductor's autotuning, no CUDA graphs) or leave mode out")
    return {k: v for k, v in config.items() if k != _CUDA_GRAPHS}
