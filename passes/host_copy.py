"""``graphshard::to_host``: a device tensor copied into host memory, pinned.

CPU offload brings each bucket's reduced gradients back to the host shard's ``.grad``. A
plain copy (``aten._to_copy``, or Inductor's lowering of ``prims.device_put``) lands in
pageable memory, which the driver copies through a staging buffer at a fraction of the
bus's bandwidth. This op allocates the destination pinned (from torch's caching host
allocator, so a step reuses the last step's blocks) and copies at full bandwidth. The copy
is blocking: ``.grad`` is complete when it returns, so autograd may accumulate into it
and the optimizer may read it. A tensor already on the CPU (the host standing in for the
device in CPU tests) is copied into ordinary memory. Inductor calls it as an extern kernel.
"""

from __future__ import annotations

import torch

__all__ = ["TO_HOST", "to_host"]


@torch.library.custom_op("graphshard::to_host", mutates_args=())
def to_host(x: torch.Tensor) -> torch.Tensor:
    """``x`` copied to a new contiguous host tensor (pinned when ``x`` is on an
    accelerator); the copy has finished when this returns."""
    out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.device.type != "cpu")
    out.copy_(x)
    return out


@to_host.register_fake
def _to_host_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


TO_HOST = torch.ops.graphshard.to_host.default
