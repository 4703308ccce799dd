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
waited for its last gradient, which comes after every shard copy it read.

Off CUDA (the host standing in for the device in the CPU tests) ``to_device`` is a
synchronous copy and ``wait_copy`` does nothing.
"""

from __future__ import annotations

import torch

__all__ = ["TO_DEVICE", "WAIT_COPY", "to_device", "wait_copy"]

# One host-to-device copy stream per CUDA device, made at its first use.
_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
# The event after each copy not yet waited for, by the result's address.
_PENDING: dict[int, torch.cuda.Event] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


@torch.library.custom_op("graphshard::to_device", mutates_args=(),
                         schema="(Tensor x, Device device) -> Tensor")
def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x`` copied to a new tensor on ``device`` (its layout kept). On CUDA the copy is
    issued on the device's copy stream and left running: read the result only after
    :func:`wait_copy` of it. Elsewhere the copy has finished when this returns."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.empty_like(x, device=device).copy_(x)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _copy_stream(device)
    with torch.cuda.stream(stream):
        out = torch.empty_like(x, device=device)  # from the copy stream's blocks
        out.copy_(x, non_blocking=True)
    out.record_stream(torch.cuda.current_stream(device))  # freed after the compute's reads
    if out.numel():
        event = torch.cuda.Event()
        event.record(stream)
        _PENDING[out.data_ptr()] = event
    return out


@to_device.register_fake
def _to_device_fake(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_like(x, device=device)


@torch.library.custom_op("graphshard::wait_copy", mutates_args=("x",),
                         schema="(Tensor(a!) x) -> ()")
def wait_copy(x: torch.Tensor) -> None:
    """The current stream waits for :func:`to_device`'s copy into ``x`` (nothing to wait
    for off CUDA, or when it was waited for already)."""
    if x.device.type != "cuda" or not x.numel():
        return
    event = _PENDING.pop(x.data_ptr(), None)
    if event is not None:
        torch.cuda.current_stream(x.device).wait_event(event)


@wait_copy.register_fake
def _wait_copy_fake(x: torch.Tensor) -> None:
    return None


TO_DEVICE = torch.ops.graphshard.to_device.default
WAIT_COPY = torch.ops.graphshard.wait_copy.default
