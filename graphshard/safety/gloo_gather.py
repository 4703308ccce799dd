"""The eager all-gather, and the gloo bug it steps around.

``torch.ops._c10d_functional.all_gather_into_tensor`` runs on a process group's
``allgather_into_tensor_coalesced``. On gloo that collective corrupts the heap when another
collective of the same group is in flight (torch 2.11, 2.13 and 2.14.1: ``malloc():
unaligned tcache chunk detected`` or ``free(): double free detected`` within a minute of
gathers issued back to back on 2 ranks), while the group's single-tensor all-gather
(``all_gather_single``, formerly ``_allgather_base``) does not, nor do two all-to-alls.
graphshard's eager reads leave a bucket's gather in flight while the step goes on, and
other collectives are then issued, so on gloo :func:`all_gather` issues the single-tensor
collective and registers its work with the output, as the functional op does: the caller's
``wait_tensor`` completes either. Other backends get the functional op.

The compiled graphs' gathers on gloo groups are ``graphshard::all_gather_single`` nodes
(``graphshard.passes.gloo_gathers``), whose kernel, here, is :func:`all_gather` of a copy of
the input where the graph may overwrite it before the wait. torch's own gathers (DTensor's
``full_tensor``, the state-dict helpers) still use the functional op: docs/torch-versions.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import graphshard.passes.markers  # noqa: F401  (defines graphshard::all_gather_single)

__all__ = ["all_gather", "all_gather_single", "backend_name", "group_and_backend"]

_c10d = torch.ops._c10d_functional

# The single-tensor all-gather: ``dist.all_gather_single`` where torch has it (2.13 and 2.14
# do, and warn that ``all_gather_into_tensor`` is deprecated), else (torch 2.11)
# ``dist.all_gather_into_tensor``, the same collective under its older name.
all_gather_single: Callable[..., Any] = getattr(
    dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(tensor: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Issue the all-gather of ``tensor`` over the group (rank-major along dim 0, as
    ``_c10d_functional.all_gather_into_tensor``) and return its output, which
    ``_c10d_functional.wait_tensor`` completes."""
    found = group_and_backend(group_name, tensor.device) if tensor.dim() > 0 else None
    if found is None or backend_name(found[1]) != "gloo":
        return _c10d.all_gather_into_tensor(tensor, group_size, group_name)
    group = found[0]
    tensor = tensor.contiguous()
    out = tensor.new_empty((group_size * tensor.shape[0], *tensor.shape[1:]))
    work = all_gather_single(out, tensor, group=group, async_op=True)
    torch._C._distributed_c10d._register_work(out, work)
    return out


def group_and_backend(group_name: str, device: torch.device) -> tuple[Any, Any] | None:
    """The process group of ``group_name`` and its backend for ``device``, or None where this
    process cannot tell (no process group, an unknown group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        group = _resolve_process_group(group_name)
        return group, group._get_backend(torch.device(device))
    except (ValueError, RuntimeError, KeyError):
        return None


def backend_name(backend: Any) -> str | None:
    """``"gloo"``, ``"nccl"``, ... for a process group's backend; None where it has no name."""
    gloo = getattr(dist, "ProcessGroupGloo", None)  # absent from builds without gloo
    if gloo is not None and isinstance(backend, gloo):
        return "gloo"
    name = getattr(backend, "name", None)
    return name() if callable(name) else None


def _all_gather_single(input: torch.Tensor, group_size: int, group_name: str, *,
                       copy_input: bool = True) -> torch.Tensor:
    """The kernel of ``graphshard::all_gather_single``: the collective owns the copy it
    sends, so the compiled graph may reuse ``input``'s buffer before the wait."""
    return all_gather(input.clone() if copy_input else input, group_size, group_name)


torch.library.register_kernel("graphshard::all_gather_single", None, _all_gather_single)
