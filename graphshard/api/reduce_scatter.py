"""Which reduce-scatter a process group gets, and the all-to-all one for gloo.

gloo has no reduce-scatter of its own: ``ProcessGroupGloo::_reduce_scatter_base`` clones the
whole input, all-reduces it and copies out one chunk, so every rank sends and receives
2(N-1)/N of the full buffer and reduces all of it. An all-to-all moves each piece straight to
the rank that owns it ((N-1)/N of the buffer, the reduce-scatter's ring volume), and the
owner then sums the N pieces it received: the same result for half the wire bytes and a
1/N-size reduction. On 2 CPU ranks (gloo over loopback) one 16 MB gradient buffer took a
median 17.0 ms as a gloo reduce-scatter and 9.9 ms as all-to-all plus sum.

The compiled path makes the same choice per graph (``Plan.reduce_scatter_via``, resolved by
:func:`group_backend` which the backend records before the passes run); the eager kernels
use :func:`reduce_scatter` so that both give the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from graphshard.passes.layout import eager, sum_received
from graphshard.passes.plan import use_all_to_all
from graphshard.safety.gloo_gather import backend_name, group_and_backend

__all__ = ["group_backend", "issue_reduce_scatter", "reduce_scatter"]

_c10d = torch.ops._c10d_functional


def group_backend(group_name: str, device: torch.device) -> str | None:
    """The name of the backend that runs collectives of ``group_name`` on ``device``
    (``"gloo"``, ``"nccl"``, ...), or None where this process cannot tell (no process group,
    an unknown group)."""
    found = group_and_backend(group_name, device)
    return None if found is None else backend_name(found[1])


def issue_reduce_scatter(flat: torch.Tensor, op: str, group_size: int, group_name: str
                         ) -> Callable[[], torch.Tensor]:
    """Issue the reduce-scatter of :func:`reduce_scatter` and return what finishes it: a
    function that waits for the collective and returns this rank's reduced piece. Between
    the two the collective runs beside whatever the caller does (on gloo in its worker
    thread, on NCCL on its stream)."""
    flat = flat.contiguous()
    if use_all_to_all("auto", group_backend(group_name, flat.device)):
        piece = flat.numel() // group_size
        splits = [piece] * group_size
        received = _c10d.all_to_all_single(flat, splits, splits, group_name)

        def summed() -> torch.Tensor:
            pieces = _c10d.wait_tensor(received)
            return sum_received(eager, pieces, group_size, average=op == "avg")

        return summed
    reduced = _c10d.reduce_scatter_tensor(flat, op, group_size, group_name)
    return lambda: _c10d.wait_tensor(reduced)


def reduce_scatter(flat: torch.Tensor, op: str, group_size: int, group_name: str) -> torch.Tensor:
    """This rank's 1/``group_size`` of ``flat`` reduced (``op``: ``"sum"`` or ``"avg"``) over
    the group, with the algorithm ``"auto"`` picks for the group's backend."""
    return issue_reduce_scatter(flat, op, group_size, group_name)()
