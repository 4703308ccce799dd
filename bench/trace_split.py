"""Where a profiled step's time goes, by kind of work: matmuls, attention, Inductor's own
kernels, communication issued and waited for, the optimizer, the rest.

``python -m bench.step ... --host-tax-steps N --trace-dir traces`` writes the trace of each
compiled system's N profiled steps (one file per system and rank); then::

    python -m bench.trace_split traces/graphshard-compiled.rank0.json traces/ddp-compiled.rank0.json

prints, per trace, the mean step's milliseconds by kind and its largest Inductor kernels
(``--events N``: also the N event names with the most self time; ``--callers NAME``: where
the events called NAME are called from).
Two systems that run the same model compare kind by kind: the same matmuls and attention,
and whatever one adds (copies in its own kernels, collectives issued on the step's thread,
waits).

The step's thread is the timeline: every instant of a step (``bench::host_tax_step``) goes
to the innermost event around it on that thread (its self time), named by :func:`kind_of`.
Other threads (gloo's, the autograd engine's) are not counted: their work shows where the
step's thread waits for it or where it slows the compute beside it.

On the CPU, Inductor's kernels appear in a trace only when compiled with its kernel profile
(``TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1`` in the environment of a cold compile: the
setting is part of the code, so use an Inductor cache directory of its own); without it
their time is the ``## Call CompiledFxGraph`` event's own, which this module counts as
``inductor kernels`` too. On a GPU the kernels run on the device: use
``--device-profile-steps`` (``bench/device_time.py``) there.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from bench.host_tax import STEP_EVENT, EventNode, event_forest, host_events_by_thread
from bench.timing import WAIT_EVENTS

__all__ = ["KINDS", "callers", "chrome_events", "kind_of", "main", "work_split"]

KINDS: tuple[str, ...] = (
    "matmul", "attention", "inductor kernels", "comm issue", "comm wait", "optimizer", "other",
)

_MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_int_mm"})
_GRAPH_CALL = "## Call CompiledFxGraph"


def kind_of(name: str) -> str:
    """The kind of work of a profiler event named ``name`` (one of :data:`KINDS`)."""
    if name in _MATMULS:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if "cpp_fused" in name or name.startswith(_GRAPH_CALL):
        return "inductor kernels"
    if name in WAIT_EVENTS:
        return "comm wait"
    if name.startswith(("c10d::", "_c10d_functional::", "graphshard::all_gather_single")):
        return "comm issue"
    if name.startswith("Optimizer.") or "_fused_adam" in name:
        return "optimizer"
    return "other"


@dataclass(frozen=True)
class _Event:
    """One complete event of a Chrome trace (times in microseconds)."""

    label: str
    start_us: float
    dur_us: float
    thread: Any  # an int, or a name for the profiler's own rows

    def name(self) -> str:
        return self.label

    def start_ns(self) -> int:
        return int(round(self.start_us * 1000))

    def duration_ns(self) -> int:
        return int(round(self.dur_us * 1000))

    def start_thread_id(self) -> Any:
        return self.thread


# Chrome-trace categories of the device's own timeline (kernels, copies, the ranges drawn
# there), left out as ``bench.host_tax.is_host_event`` leaves out a kineto device event.
_DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})


def chrome_events(path: str) -> list[_Event]:
    """The complete (``"ph": "X"``) host events of a Chrome trace written by
    ``torch.profiler``, as objects with the kineto event methods :func:`work_split` reads."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [_Event(e["name"], float(e["ts"]), float(e.get("dur", 0)), e.get("tid", 0))
            for e in events if e.get("ph") == "X" and e.get("cat") not in _DEVICE_CATEGORIES]


def work_split(events: Iterable[Any], step_event: str = STEP_EVENT,
               top_kernels: int = 8, top_events: int = 0) -> dict[str, Any]:
    """The mean step of the ``step_event`` ranges in ``events`` (kineto events, or
    :func:`chrome_events`), on each step's own thread: ``steps``, ``step_ms``, one
    ``<kind>_ms`` per :data:`KINDS` (self times; they sum to ``step_ms``), ``kernels``,
    the ``top_kernels`` Inductor kernels (``cpp_fused...`` events) with the most time, as
    ``(name, ms a step, calls a step)``, and ``events``, the ``top_events`` event names of
    any kind with the most self time, as ``(kind, name, ms a step, calls a step)``: what
    two systems' ``other`` or ``inductor kernels`` differ by. Device events are left out
    (``bench.host_tax``'s rules, which also build each thread's tree of events)."""
    totals = dict.fromkeys(KINDS, 0.0)
    by_name: dict[str, list[float]] = {}  # event name -> [self ns, calls]
    step_nodes = _steps(events, step_event)
    steps, step_ns = len(step_nodes), sum(step.end - step.start for step in step_nodes)
    for step in step_nodes:
        _add_self_times(step, "other", totals, by_name)
    if not steps:
        return {"steps": 0, "step_ms": 0.0, **{f"{k}_ms": 0.0 for k in KINDS},
                "kernels": [], "events": []}
    per = 1e6 * steps
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    kernels = [(name, ns, calls) for name, (ns, calls) in ranked if "cpp_fused" in name]
    return {
        "steps": steps,
        "step_ms": step_ns / per,
        **{f"{k}_ms": totals[k] / per for k in KINDS},
        "kernels": [(name, ns / per, calls / steps) for name, ns, calls in kernels[:top_kernels]],
        "events": [(kind_of(name), name, ns / per, calls / steps)
                   for name, (ns, calls) in ranked[:top_events]],
    }


def callers(events: Iterable[Any], name: str, step_event: str = STEP_EVENT,
            depth: int = 2) -> list[tuple[str, float, float]]:
    """Where the ``name`` events of the mean step (as :func:`work_split` counts steps) are
    called from: ``(the innermost `depth` enclosing event names, joined by " > ", ms a
    step, calls a step)``, most time first, a call's time being its whole duration. Tells
    apart, say, the copies that a collective makes from those that a model makes."""
    totals: dict[str, list[float]] = {}

    def visit(node: EventNode, path: list[str]) -> None:
        if node.name == name:
            entry = totals.setdefault(" > ".join(path[-depth:]), [0.0, 0])
            entry[0] += node.end - node.start
            entry[1] += 1
        for child in node.children:
            visit(child, [*path, node.name])

    step_nodes = _steps(events, step_event)
    for step in step_nodes:
        visit(step, [])
    steps = len(step_nodes)
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return [(where, ns / (1e6 * steps), calls / steps) for where, (ns, calls) in ranked
            ] if steps else []


def _steps(events: Iterable[Any], step_event: str) -> list[EventNode]:
    """The ``step_event`` ranges among ``events``' host events, each the tree of the events
    inside it on its own thread."""
    return [step for spans in host_events_by_thread(events).values()
            for step in _named(event_forest(spans), step_event)]


def _named(nodes: list[EventNode], name: str) -> Iterator[EventNode]:
    """The outermost nodes called ``name`` among ``nodes`` and their descendants."""
    for node in nodes:
        if node.name == name:
            yield node
        else:
            yield from _named(node.children, name)


def _add_self_times(node: EventNode, kind: str, totals: dict[str, float],
                    by_name: dict[str, list[float]]) -> None:
    """Add ``node``'s self time to ``kind`` and to its name's entry, then its children's,
    each to its own kind."""
    own = (node.end - node.start) - sum(c.end - c.start for c in node.children)
    totals[kind] += own
    entry = by_name.setdefault(node.name, [0.0, 0])
    entry[0] += own
    entry[1] += 1
    for child in node.children:
        _add_self_times(child, kind_of(child.name), totals, by_name)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Print the split of each trace named on the command line; return the splits."""
    parser = argparse.ArgumentParser(prog="python -m bench.trace_split", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="Chrome traces from bench.step --trace-dir")
    parser.add_argument("--top", type=int, default=8, help="Inductor kernels to list")
    parser.add_argument("--events", type=int, default=0, metavar="N",
                        help="also list the N event names with the most self time, of any "
                             "kind (what two traces' 'other' differ by)")
    parser.add_argument("--callers", metavar="NAME",
                        help="also list where the events called NAME are called from")
    args = parser.parse_args(argv)
    splits = []
    header = " | ".join(KINDS)
    print(f"| trace | steps | step ms | {header} |")
    print("|---|---:|---:|" + "---:|" * len(KINDS))
    traces = [(path, chrome_events(path)) for path in args.traces]
    for path, events in traces:
        split = work_split(events, top_kernels=args.top, top_events=args.events)
        splits.append(split)
        cells = " | ".join(f"{split[f'{k}_ms']:.1f}" for k in KINDS)
        print(f"| {path} | {split['steps']} | {split['step_ms']:.1f} | {cells} |")
    for (path, events), split in zip(traces, splits, strict=True):
        if split["kernels"]:
            print(f"\n{path}: largest Inductor kernels, ms a step (calls a step)")
            for name, ms, calls in split["kernels"]:
                print(f"  {ms:7.2f} ({calls:g})  {name}")
        if split["events"]:
            print(f"\n{path}: events with the most self time, ms a step (calls a step)")
            for kind, name, ms, calls in split["events"]:
                print(f"  {ms:7.2f} ({calls:g})  {kind}: {name}")
        if args.callers:
            print(f"\n{path}: {args.callers}, ms a step (calls a step), by its callers")
            for where, ms, calls in callers(events, args.callers):
                print(f"  {ms:7.2f} ({calls:g})  {where}")
    return splits


if __name__ == "__main__":
    main()
