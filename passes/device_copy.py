"""``graphshard::to_device`` and ``graphshard::wait_copy``: a host shard's copy to the device,
issued on a copy stream and waited for where it is first read.

CPU offload copies each bucket's host shards to the device before its gather. As one node
(``prims.device_put``) the copy runs on the compute stream: in order with the kernels, so a
bucket's shards cross the bus while nothing computes, and, in the backward, in series with
the gradients' copies the other way. With ``graphshard.backend(shard_copy_stream=True)``
(:mod:`graphshard.passes.shard_copy_stream`) the copy is split in two:

- ``to_device(x, device)`` allocates the result from the copy stream's memory, copies the
  host tensor into it there (non-blocking: from pinned memory the host does not wait), and
  records an event after it. ``record_stream`` on the current stream keeps the allocator
  from handing the block to a later copy before the compute stream is done with it.
- ``wait_copy(x)`` makes the current stream wait for that event. It is declared to write
  ``x`` (it writes nothing), so that every scheduler orders each reader of ``x`` after it.

Between the two the compute stream runs on: the pass issues a bucket's copies one bucket
ahead of their wait. The copy stream is not the gradients' (:mod:`graphshard.passes.host_copy`),
so the two directions share the full-duplex bus. The source needs no event: it is host
memory that only the host writes, and the host's optimizer step runs after the backward has
waited for its last gradient, which comes after every shard copy it read. Nor can
Inductor's in-graph buffer reuse write over it while the copy reads it (to Inductor this is
an opaque op after which a dead source may be reused): a pinned source is a host shard, a
graph input, which Inductor never reuses; a source the graph computes is pageable (Inductor
does not pin), and a copy from pageable memory has read its source before it returns.

Off CUDA (the host standing in for the device in the CPU tests) ``to_device`` is a
synchronous copy and ``wait_copy`` does nothing. Only the schemas and the fake (shape)
implementations live here; the kernels are :mod:`graphshard.api.copy_streams`.
"""

from __future__ import annotations

import torch

__all__ = ["TO_DEVICE", "WAIT_COPY"]

torch.library.define("graphshard::to_device", "(Tensor x, Device device) -> Tensor")
torch.library.define("graphshard::wait_copy", "(Tensor(a!) x) -> ()")


@torch.library.register_fake("graphshard::to_device")
def _to_device_fake(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(x, device=device)


@torch.library.register_fake("graphshard::wait_copy")
def _wait_copy_fake(x: torch.Tensor) -> None:
    return None


TO_DEVICE = torch.ops.graphshard.to_device.default
WAIT_COPY = torch.ops.graphshard.wait_copy.default
