"""Kernels of CPU offload's copies between host and device (``graphshard::to_host``,
``graphshard::to_device``, ``graphshard::wait_copy``; schemas and semantics in
:mod:`graphshard.passes.host_copy` and :mod:`graphshard.passes.device_copy`).

On CUDA each direction has a copy stream of its own per device, so the shards going to the
device and the gradients coming back share the full-duplex bus. A copy left running records
an event, found again by its result's address when it is waited for (``wait_copy``) or
retired (``to_host``'s ``retire``). Off CUDA (the host standing in for the device in the CPU
tests) every copy is synchronous.
"""

from __future__ import annotations

import torch

__all__: list[str] = []

# (device, "h2d" | "d2h") -> that direction's copy stream, made at its first use.
_STREAMS: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
# (device type, address) of a running copy's result -> the event after it.
_EVENTS: dict[tuple[str, int], torch.cuda.Event] = {}


def _copy_stream(device: torch.device, direction: str) -> torch.cuda.Stream:
    stream = _STREAMS.get((device, direction))
    if stream is None:
        stream = _STREAMS[device, direction] = torch.cuda.Stream(device=device)
    return stream


def _record(result: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Remember the event after the copy into ``result``, issued on ``stream``."""
    if result.numel():
        event = torch.cuda.Event()
        event.record(stream)
        _EVENTS[result.device.type, result.data_ptr()] = event


def _take(result: torch.Tensor) -> torch.cuda.Event | None:
    """The event of the running copy into ``result``, forgotten (None: none running)."""
    return _EVENTS.pop((result.device.type, result.data_ptr()), None)


def _to_host(x: torch.Tensor, wait: bool = True, issued: list[torch.Tensor] | None = None,
             retire: list[torch.Tensor] | None = None) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.device.type != "cpu")
    if x.device.type != "cuda" or (wait and issued is None):
        out.copy_(x)
        return out
    current = torch.cuda.current_stream(x.device)
    for done in (retire or ()):
        event = _take(done) if done.device.type == "cpu" else None  # (sources: life only)
        if event is not None:
            current.wait_event(event)  # their sources may be reused after this point
    stream = _copy_stream(x.device, "d2h")
    stream.wait_stream(current)  # x and all before it are ready
    with torch.cuda.stream(stream):
        out.copy_(x, non_blocking=True)  # the host allocator keeps ``out`` until it is done
    x.record_stream(stream)  # the device allocator keeps ``x`` until the copy has read it
    if wait:
        stream.synchronize()
        for done in (issued or ()):
            _take(done)
    else:
        _record(out, stream)
    return out


def _to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return torch.empty_like(x, device=device).copy_(x)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _copy_stream(device, "h2d")
    with torch.cuda.stream(stream):
        out = torch.empty_like(x, device=device)  # from the copy stream's blocks
        out.copy_(x, non_blocking=True)
    out.record_stream(torch.cuda.current_stream(device))  # freed after the compute's reads
    _record(out, stream)
    return out


def _wait_copy(x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        return
    event = _take(x)
    if event is not None:
        torch.cuda.current_stream(x.device).wait_event(event)


torch.library.register_kernel("graphshard::to_host", None, _to_host)
torch.library.register_kernel("graphshard::to_device", None, _to_device)
torch.library.register_kernel("graphshard::wait_copy", None, _wait_copy)
