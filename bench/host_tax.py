"""The host tax: where a training step's time goes outside the compiled graphs.

A few steady-state steps run under ``torch.profiler`` (CPU activity only, no shapes, no
memory, no stacks), each inside a :data:`STEP_EVENT` record function. Every instant of a
step is given to exactly one bucket, so the buckets of a step sum to its duration:

==============  ===========================================================================
bucket          the instants inside...
==============  ===========================================================================
``compiled``    a compiled graph's call (``## Call CompiledFxGraph <key> ##``, Inductor's
                output code): its kernels, the ATen ops it calls (matmuls, attention), and
                the collectives and waits it issues. Not host tax: the work itself.
``guards``      Dynamo's ``TorchDynamo Cache Lookup``: evaluating a frame's guards to pick
                its compiled code (guards on every parameter, DTensor ones included).
``wrappers``    AOTAutograd's runtime around the compiled graphs, minus the graph calls:
                ``CompiledFunction`` (the forward ``autograd.Function``),
                ``CompiledFunctionBackward`` with the autograd engine's
                ``evaluate_function`` event around it, ``AOTDispatcher Runtime Wrapper
                Prologue`` and ``Pregraph bytecode``, and the self time of Dynamo's
                ``Torch-Compiled Region`` (its bytecode and the outer runtime wrappers,
                which record no event of their own). Here are the unwrapping of DTensor
                inputs to local tensors and the wrapping of the backward's gradients into
                DTensors, saved tensors, output aliasing and the like.
``optimizer``   ``Optimizer.step#...`` and ``Optimizer.zero_grad#...`` (eager: AdamW's
                arithmetic and, for DTensor parameters, DTensor's dispatch on every op).
``wait``        the bench's own waits: the device synchronisation at the end of the step
                (``bench::sync``, nothing on the CPU) and graphshard's wait for the gathers
                its optimizer step issued (``bench::settle_step_prefetch``).
``rest``        everything else in the step: eager code outside the compiled frames
                (``ones_like`` for the loss's gradient, ``AccumulateGrad`` and its
                ``detach``, eager hooks such as FSDP2's copy-in and copy-out or DDP's
                reducer, the code a compiled frame runs eagerly at a graph break) and
                Python time with no event of its own.
==============  ===========================================================================

An instant belongs to the innermost event around it that names a bucket; an event that
names none takes its parent's bucket, the step itself ``rest``. Dynamo's ``Torch-Compiled
Region`` is the exception: its own (self) time is ``wrappers``, and an event inside it that
names no bucket takes the bucket around the region, so eager code at a graph break is
``rest`` (``optimizer`` inside a compiled optimizer step) and not wrapper time.
Self time is an event's duration minus the time covered by the events inside it, so no
instant is counted twice. ``host`` is the step's time outside the graph calls and the waits:
``guards + wrappers + optimizer + rest``.

``subclass``, across the buckets (not added to them): the self time of the profiler's
``PythonSubclass`` events outside the compiled graphs, that is the Python
``__torch_dispatch__`` of a tensor subclass (DTensor's sharding propagation, unwrapping and
rewrapping), less the local ATen ops it runs inside; ``subclass_by_bucket`` says which
bucket it fell in.

With a real network, a wait on an eager collective (DDP's reducer, FSDP2's hooks) is
``rest`` while the compiled graphs' waits are ``compiled``: compare host figures across
systems in a fake world (``--fake-world N``), where no collective waits.

Threads: the step's own thread is the timeline. Where it is in ``rest`` and another thread
is inside an event of another bucket at that instant (the autograd engine's device thread
running the backward on a GPU while the caller waits), the instant takes that bucket
(``compiled`` first, then ``guards``, ``wrappers``, ``optimizer``, ``wait``).

The profiler adds a little time per recorded op, most in code that runs many small eager
ops (AdamW's per-parameter loop): the profiled step is longer than an unprofiled one, and
``step_s`` is the profiled step, so the split is of that step. The bench
(``python -m bench.step --host-tax-steps N``) reports the split of the median of N profiled
steps (:func:`median_split`), a real step whose parts still sum to it.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from bench.systems import SETTLE_EVENT  # graphshard's wait for its optimizer step's gathers

__all__ = [
    "BUCKETS",
    "HOST_BUCKETS",
    "STEP_EVENT",
    "SYNC_EVENT",
    "applies_to",
    "EventNode",
    "classify",
    "event_forest",
    "host_events_by_thread",
    "is_host_event",
    "median_split",
    "profile_steps",
    "split_events",
    "sync_event",
]

# The record function around each profiled step, and around the bench's device sync.
STEP_EVENT = "bench::host_tax_step"
SYNC_EVENT = "bench::sync"

# Every instant of a step is in one of these, in this order of priority across threads.
BUCKETS: tuple[str, ...] = ("compiled", "guards", "wrappers", "optimizer", "wait", "rest")
# The buckets that make up the host tax.
HOST_BUCKETS: tuple[str, ...] = ("guards", "wrappers", "optimizer", "rest")

_GRAPH_CALL = "## Call CompiledFxGraph"
_CACHE_LOOKUP = "TorchDynamo Cache Lookup"
_REGION = "Torch-Compiled Region"
_WRAPPER_EVENTS = frozenset({
    "CompiledFunction",
    "CompiledFunctionBackward",
    "autograd::engine::evaluate_function: CompiledFunctionBackward",
    "AOTDispatcher Runtime Wrapper Prologue",
    "Pregraph bytecode",
})  # fmt: skip
_OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
_SUBCLASS = "PythonSubclass"
# a region's own time is wrapper time; its children take the bucket around it
_REGION_MARK = "region"


def classify(name: str) -> str | None:
    """The bucket an event of this name puts the time inside it in, ``"region"`` for
    Dynamo's ``Torch-Compiled Region``, None where it names no bucket (it takes its
    parent's)."""
    if name.startswith(_GRAPH_CALL):
        return "compiled"
    if name == _CACHE_LOOKUP:
        return "guards"
    if name in _WRAPPER_EVENTS:
        return "wrappers"
    if name.startswith(_REGION):
        return _REGION_MARK
    if name.startswith(_OPTIMIZER_PREFIXES):
        return "optimizer"
    if name in (SYNC_EVENT, SETTLE_EVENT):
        return "wait"
    return None


def applies_to(system: str) -> bool:
    """Whether the split means something for ``system``: every system that runs compiled
    graphs. An eager system's step is all host time (its whole compute is ``rest``)."""
    return not system.endswith("-eager")


# ----------------------------------------------------------------------------- the split


@dataclass
class EventNode:
    """A profiler event and the events inside it on its thread (:func:`event_forest`)."""

    name: str
    start: int
    end: int
    children: list[EventNode] = field(default_factory=list)


@dataclass(frozen=True)
class _Span:
    start: int
    end: int
    bucket: str
    subclass: bool


def is_host_event(event: Any) -> bool:
    """Whether a kineto event (or an object with its methods) is the host's: a CPU one, or
    one that names no device."""
    cpu = getattr(getattr(torch.autograd, "DeviceType", None), "CPU", None)
    device_type = getattr(event, "device_type", None)
    return cpu is None or device_type is None or device_type() == cpu


def _host_event_tuples(events: Iterable[Any]) -> Iterator[tuple[str, int, int, int]]:
    """(name, start ns, end ns, thread) of the CPU-side events of a kineto trace (or of any
    objects with the same methods)."""
    for e in events:
        if not is_host_event(e):
            continue
        start = e.start_ns()
        yield e.name(), start, start + e.duration_ns(), e.start_thread_id()


def host_events_by_thread(events: Iterable[Any]) -> dict[Any, list[tuple[str, int, int]]]:
    """The host events of ``events`` (:func:`_host_event_tuples`) by thread, each as
    ``(name, start ns, end ns)``."""
    by_thread: dict[Any, list[tuple[str, int, int]]] = {}
    for name, start, end, thread in _host_event_tuples(events):
        by_thread.setdefault(thread, []).append((name, start, end))
    return by_thread


def event_forest(spans: list[tuple[str, int, int]]) -> list[EventNode]:
    """One thread's events, ``(name, start, end)``, as trees by containment (parents first
    at equal starts; a child that outlasts its parent is cut at the parent's end)."""
    roots: list[EventNode] = []
    stack: list[EventNode] = []
    for name, start, end in sorted(spans, key=lambda s: (s[1], -s[2])):
        node = EventNode(name, start, end)
        while stack and stack[-1].end <= start:
            stack.pop()
        if stack and end > stack[-1].end:  # not nested (never in a well-formed trace)
            node.end = stack[-1].end
        (stack[-1].children if stack else roots).append(node)
        stack.append(node)
    return roots


def _self_spans(node: EventNode, outer: str, out: list[_Span]) -> None:
    """Append ``node``'s self-time spans, labelled, then its children's; ``outer`` is the
    bucket around it."""
    own = classify(node.name)
    if own == _REGION_MARK:
        mine, inherited = "wrappers", outer
    else:
        mine = inherited = own or outer
    subclass = node.name == _SUBCLASS
    cursor = node.start
    for child in node.children:
        if child.start > cursor:
            out.append(_Span(cursor, child.start, mine, subclass))
        _self_spans(child, inherited, out)
        cursor = max(cursor, child.end)
    if node.end > cursor:
        out.append(_Span(cursor, node.end, mine, subclass))


def _thread_spans(spans: list[tuple[str, int, int]]) -> list[_Span]:
    out: list[_Span] = []
    for root in event_forest(spans):
        _self_spans(root, "rest", out)
    return sorted(out, key=lambda s: s.start)


def _empty() -> dict[str, Any]:
    split: dict[str, Any] = {f"{b}_s": 0.0 for b in BUCKETS}
    split["subclass_by_bucket"] = {b: 0.0 for b in BUCKETS}
    return split


def split_events(events: Iterable[Any], step_event: str = STEP_EVENT) -> list[dict[str, Any]]:
    """The split of every ``step_event`` in a trace, in time order.

    ``events`` are kineto events (``prof.profiler.kineto_results.events()``) or objects with
    their ``name()``, ``start_ns()``, ``duration_ns()`` and ``start_thread_id()``. Each split
    has ``step_s``, one ``<bucket>_s`` per :data:`BUCKETS` (they sum to ``step_s``),
    ``host_s`` (the :data:`HOST_BUCKETS`), ``subclass_s`` and ``subclass_by_bucket``, in
    seconds; see the module docstring for the definitions.
    """
    by_thread = host_events_by_thread(events)
    steps = sorted(
        (start, end, thread)
        for thread, spans in by_thread.items()
        for name, start, end in spans
        if name == step_event
    )
    labelled = {thread: _thread_spans(spans) for thread, spans in by_thread.items()}
    return [_split_step(start, end, thread, labelled) for start, end, thread in steps]


def _clip(spans: list[_Span], start: int, end: int) -> list[_Span]:
    """The parts of ``spans`` (sorted, not overlapping) inside [start, end)."""
    first = bisect.bisect_right(spans, start, key=lambda s: s.end)
    out = []
    for s in spans[first:]:
        if s.start >= end:
            break
        lo, hi = max(s.start, start), min(s.end, end)
        if hi > lo:
            out.append(_Span(lo, hi, s.bucket, s.subclass))
    return out


def _split_step(
    start: int, end: int, thread: int, labelled: dict[int, list[_Span]]
) -> dict[str, Any]:
    main = _clip(labelled[thread], start, end)
    # other threads' time in a bucket other than rest, by priority where they overlap
    others = [
        s for t, spans in labelled.items() if t != thread
        for s in _clip(spans, start, end) if s.bucket != "rest"
    ]  # fmt: skip
    split = _empty()
    for span in main:
        pieces = [span]
        if span.bucket == "rest" and others:
            pieces = _fill_from_others(span, others)
        for piece in pieces:
            seconds = (piece.end - piece.start) / 1e9
            split[f"{piece.bucket}_s"] += seconds
            if piece.subclass and piece.bucket != "compiled":
                split["subclass_by_bucket"][piece.bucket] += seconds
    split["step_s"] = (end - start) / 1e9
    split["host_s"] = sum(split[f"{b}_s"] for b in HOST_BUCKETS)
    split["subclass_s"] = sum(split["subclass_by_bucket"].values())
    return split


def _fill_from_others(span: _Span, others: list[_Span]) -> list[_Span]:
    """``span`` (rest on the step's thread) cut where other threads are in another bucket:
    each piece takes the highest-priority bucket among them, rest where none is."""
    cuts = {span.start, span.end}
    inside = [o for o in others if o.start < span.end and o.end > span.start]
    for o in inside:
        cuts.update(c for c in (o.start, o.end) if span.start < c < span.end)
    points = sorted(cuts)
    pieces = []
    for lo, hi in zip(points, points[1:], strict=False):
        active = [o for o in inside if o.start <= lo and o.end >= hi]
        if active:
            best = min(active, key=lambda o: BUCKETS.index(o.bucket))
            pieces.append(_Span(lo, hi, best.bucket, best.subclass))
        else:
            pieces.append(_Span(lo, hi, span.bucket, span.subclass))
    return pieces


def median_split(splits: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The split of the median step among ``splits`` (by ``step_s``; the lower of the two
    middle ones for an even count), one real step so its parts still sum to it, with
    ``steps`` (how many were profiled) and ``step_s_all`` (each one's ``step_s``); None for
    no steps. A slow spell of a shared machine that lands on one step moves no bucket."""
    if not splits:
        return None
    ordered = sorted(splits, key=lambda s: s["step_s"])
    chosen = ordered[(len(ordered) - 1) // 2]
    return {**chosen, "steps": len(splits), "step_s_all": [s["step_s"] for s in splits]}


# ----------------------------------------------------------------------------- measuring


def profile_steps(
    step: Callable[[Any], None], steps: int, prepare: Callable[[], Any] = lambda: None,
    trace_path: str | None = None,
) -> list[dict[str, Any]]:
    """Run ``step(prepare())`` ``steps`` times under the profiler (CPU activity, no shapes,
    no memory) and return each step's split (:func:`split_events`).

    ``prepare`` (the batch, a barrier) runs inside the profile but outside the step's
    event; ``step`` should mark its device synchronisation with :func:`sync_event`.
    ``trace_path``: also write the profile there as a Chrome trace (``bench.trace_split``
    reads it).
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(steps):
            arg = prepare()
            with record_function(STEP_EVENT):
                step(arg)
    if trace_path is not None:
        prof.export_chrome_trace(trace_path)
    return split_events(prof.profiler.kineto_results.events())


@contextlib.contextmanager
def sync_event() -> Iterator[None]:
    """A record function that marks the step's device synchronisation (bucket ``wait``)."""
    with torch.profiler.record_function(SYNC_EVENT):
        yield
