"""``graphshard::to_host``: a device tensor copied into host memory, pinned.

CPU offload brings each bucket's reduced gradients back to the host shard's ``.grad``. A
plain copy (``aten._to_copy``, or Inductor's lowering of ``prims.device_put``) lands in
pageable memory, which the driver copies through a staging buffer at a fraction of the
bus's bandwidth. This op allocates the destination pinned (from torch's caching host
allocator, so a step reuses the last step's blocks) and copies at full bandwidth. A tensor
already on the CPU (the host standing in for the device in CPU tests) is copied into
ordinary memory. Inductor calls it as an extern kernel.

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

__all__ = ["TO_HOST", "to_host"]

# One copy stream per CUDA device, made at its first use.
_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


# The event after each running copy, by its result's address (retired or waited for later).
_RUNNING: dict[int, torch.cuda.Event] = {}


def _forget(tensors: list[torch.Tensor] | None) -> list[torch.cuda.Event]:
    """The events of the running copies among ``tensors`` (host results), forgotten."""
    events = (_RUNNING.pop(t.data_ptr(), None) for t in tensors or () if t.device.type == "cpu")
    return [event for event in events if event is not None]


@torch.library.custom_op(
    "graphshard::to_host", mutates_args=(),
    schema="(Tensor x, bool wait=True, Tensor[]? issued=None, Tensor[]? retire=None) -> Tensor",
)
def to_host(x: torch.Tensor, wait: bool = True, issued: list[torch.Tensor] | None = None,
            retire: list[torch.Tensor] | None = None) -> torch.Tensor:
    """``x`` copied to a new contiguous host tensor (pinned when ``x`` is on an
    accelerator). ``wait``: the copy, and on CUDA with ``issued`` every copy issued before
    it on the copy stream, has finished when this returns. ``wait=False`` (CUDA): the copy
    is issued on the copy stream and left running; the result may be read only after a
    later copy that waits. ``retire`` (CUDA): results of earlier running copies, and their
    sources: the current stream waits for those copies first (module docstring). Elsewhere
    every copy waits."""
    out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.device.type != "cpu")
    if x.device.type != "cuda" or (wait and issued is None):
        out.copy_(x)
        return out
    current = torch.cuda.current_stream(x.device)
    for event in _forget(retire):
        current.wait_event(event)  # their sources may be reused after this point
    stream = _copy_stream(x.device)
    stream.wait_stream(current)  # x and all before it are ready
    with torch.cuda.stream(stream):
        out.copy_(x, non_blocking=True)  # the host allocator keeps ``out`` until it is done
    x.record_stream(stream)  # the device allocator keeps ``x`` until the copy has read it
    if wait:
        stream.synchronize()
        _forget(issued)
    else:
        event = torch.cuda.Event()
        event.record(stream)
        _RUNNING[out.data_ptr()] = event
    return out


@to_host.register_fake
def _to_host_fake(x: torch.Tensor, wait: bool = True, issued: list[torch.Tensor] | None = None,
                  retire: list[torch.Tensor] | None = None) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


TO_HOST = torch.ops.graphshard.to_host.default
