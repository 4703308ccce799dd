"""``graphshard::to_host``: a device tensor copied into host memory, pinned.

CPU offload brings each bucket's reduced gradients back to the host shard's ``.grad``. A
plain copy (``aten._to_copy``, or Inductor's lowering of ``prims.device_put``) lands in
pageable memory, which the driver copies through a staging buffer at a fraction of the
bus's bandwidth. This op allocates the destination pinned (from torch's caching host
allocator, so a step reuses the last step's blocks) and copies at full bandwidth. A tensor
already on the CPU (the host standing in for the device in CPU tests) is copied into
ordinary memory. Inductor calls it as an extern kernel. Only the schema and the fake (shape)
implementation live here; the kernel is :mod:`graphshard.api.copy_streams`.

By default (``wait=True``) the copy runs on the current stream and is waited for: ``.grad``
is complete when it returns, so autograd may accumulate into it and the optimizer may read
it. Each such copy stops the host until the device has caught up, and on the compute stream
it cannot overlap the host-to-device copies of the next buckets' gathers.

With ``graphshard.backend(grad_copy_stream=True)`` (:mod:`graphshard.passes.grad_copy_stream`)
the copies of a CUDA graph run on a copy stream of their own, after the work issued so far
on the current stream: there they overlap compute and, the bus being full duplex, the
host-to-device copies. A copy that nothing reads before the graph returns is not waited for
(``wait=False``); it records an event. At most two buckets' copies run at once: a
bucket's first copy lists as ``retire`` the results and device sources of the copies of the
bucket two before it, and the current stream waits for their events before going on, so
the sources' memory is free for reuse after that point of the compute stream (Inductor's
in-graph buffer reuse knows one stream only; the operands keep the sources alive until
there). A copy that the graph reads, and the graph's
last, waits on the host for itself and so for every copy issued before it on that stream,
and takes the copies still running and their sources as ``issued``, which it does not read:
they order it after those copies and keep the sources alive until then.
"""

from __future__ import annotations

import torch

__all__ = ["TO_HOST"]

torch.library.define(
    "graphshard::to_host",
    "(Tensor x, bool wait=True, Tensor[]? issued=None, Tensor[]? retire=None) -> Tensor",
)


@torch.library.register_fake("graphshard::to_host")
def _to_host_fake(x: torch.Tensor, wait: bool = True, issued: list[torch.Tensor] | None = None,
                  retire: list[torch.Tensor] | None = None) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


TO_HOST = torch.ops.graphshard.to_host.default
