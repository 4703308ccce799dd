"""Device time: what an accelerator does during a training step, from its own activity.

The host-tax split (:mod:`bench.host_tax`) says where the host's time goes; it cannot say
whether the device waited on the host or was busy the whole step. This module answers that
from the profiler's device activity (kernels, memory copies and sets, ``ProfilerActivity.
CUDA``), step by step:

=============  ==========================================================================
field          meaning
=============  ==========================================================================
``step_s``     the step (the bench's ``bench::host_tax_step`` event, sync included)
``busy_s``     the union of the device's activity intervals inside the step: time some
               kernel, copy or set ran (overlapping streams counted once)
``idle_s``     ``step_s - busy_s``: the device waited (on the host, a sync, a collective
               on another device)
``kernel_s``   the sum of the kernels' durations (more than ``busy_s`` where streams
               overlap)
``copy_s``     the sum of the memory copies' and sets' durations
``kernels``    how many kernels ran
``families``   kernels by family (``triton_poi``, ``triton_red``, ``triton_per``,
               ``triton_other``, ``nccl``, ``multi_tensor``, ``attention``, ``gemm``,
               ``elementwise``, ``reduction``, ``other``): ``{family: [seconds,
               count]}``, so two systems' kernel counts compare where ``top`` cannot
               reach (many small kernels)
``top``        the largest kernels by total time: ``[name, seconds, count]`` rows
=============  ==========================================================================

A step owns the device activity that starts inside it: the bench synchronises the device
at the end of every step, so nothing launched in a step runs after it. The profiler also
draws each ``record_function`` range (the step's own event, ``Optimizer.step#...``, FSDP2's
hooks) on the device's timeline as a user annotation, from its first kernel to its last:
those are no activity and are left out.

Two systems with the same model and data compare kernel by kernel: ``top`` shows the
kernels one of them runs and the other does not (copies, casts, the optimizer's), and
``idle_s`` says how much of a step the host left the device waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from bench.host_tax import STEP_EVENT, is_host_event, median_split

__all__ = ["TOP_KERNELS", "device_split", "kernel_family", "profile_device_steps"]

# Rows of ``top`` a step keeps.
TOP_KERNELS = 25
# kernel name marker -> family, first match wins (``other`` where none does)
_FAMILIES: tuple[tuple[str, str], ...] = (
    ("triton_poi", "triton_poi"),
    ("triton_red", "triton_red"),
    ("triton_per", "triton_per"),
    ("triton", "triton_other"),
    ("nccl", "nccl"),
    ("multi_tensor_apply", "multi_tensor"),
    ("sdpa", "attention"),
    ("fmha", "attention"),
    ("flash", "attention"),
    ("nvjet", "gemm"),
    ("gemm", "gemm"),
    ("cutlass", "gemm"),
    ("elementwise_kernel", "elementwise"),
    ("reduce_kernel", "reduction"),
)
_COPY_PREFIXES = ("Memcpy", "Memset")
_NAME_CHARS = 120  # kernel names (templated C++) shortened to this many characters


def kernel_family(name: str) -> str:
    """The family of a kernel by its name (``families`` in the module docstring)."""
    lowered = name.lower()
    for marker, family in _FAMILIES:
        if marker in lowered:
            return family
    return "other"


def _is_annotation(event: Any) -> bool:
    marked = getattr(event, "is_user_annotation", None)
    return bool(marked()) if callable(marked) else False


def device_split(events: Iterable[Any], step_event: str = STEP_EVENT,
                 top: int = TOP_KERNELS) -> list[dict[str, Any]]:
    """The device time of every ``step_event`` in a trace, in time order (the fields in the
    module docstring, in seconds).

    ``events`` are kineto events (``prof.profiler.kineto_results.events()``) or objects
    with their ``name()``, ``start_ns()``, ``duration_ns()`` and ``device_type()``: host
    events give the steps, the others are the device's activity.
    """
    steps: list[tuple[int, int]] = []
    host_names: set[str] = set()
    device: list[tuple[int, int, str]] = []
    for e in events:
        start = e.start_ns()
        end = start + e.duration_ns()
        if is_host_event(e):
            host_names.add(e.name())
            if e.name() == step_event:
                steps.append((start, end))
        elif not _is_annotation(e):
            device.append((start, end, e.name()))
    # a range drawn on the device's timeline bears its host event's name
    activity = sorted(a for a in device if a[2] not in host_names)
    return [_one_step(start, end, activity, top) for start, end in sorted(steps)]


def _one_step(start: int, end: int, activity: list[tuple[int, int, str]],
              top: int) -> dict[str, Any]:
    inside = [a for a in activity if start <= a[0] < end]
    busy = covered_until = 0
    kernel = copy = 0
    kernels = 0
    by_name: dict[str, list[float]] = {}
    families: dict[str, list[float]] = {}
    for lo, hi, name in inside:
        if hi > covered_until:  # the union of intervals, sorted by start
            busy += hi - max(lo, covered_until)
            covered_until = hi
        if name.startswith(_COPY_PREFIXES):
            copy += hi - lo
            continue
        kernel += hi - lo
        kernels += 1
        for table, key in ((by_name, name[:_NAME_CHARS]), (families, kernel_family(name))):
            row = table.setdefault(key, [0.0, 0])
            row[0] += (hi - lo) / 1e9
            row[1] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    step_s = (end - start) / 1e9
    return {
        "step_s": step_s,
        "busy_s": busy / 1e9,
        "idle_s": max(0.0, step_s - busy / 1e9),
        "kernel_s": kernel / 1e9,
        "copy_s": copy / 1e9,
        "kernels": kernels,
        "families": {f: [sec, int(n)] for f, (sec, n) in sorted(families.items())},
        "top": [[name, seconds, int(count)] for name, (seconds, count) in ranked],
    }


def profile_device_steps(step: Callable[[Any], None], steps: int,
                         prepare: Callable[[], Any] = lambda: None) -> dict[str, Any] | None:
    """Run ``step(prepare())`` ``steps`` times under the profiler with the device's activity
    and return the median step's device time (:func:`bench.host_tax.median_split`), None
    where no accelerator's activity can be recorded (a CPU run)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if not steps or not torch.cuda.is_available():
        return None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            arg = prepare()
            with record_function(STEP_EVENT):
                step(arg)
    return median_split(device_split(prof.profiler.kineto_results.events()))
