"""Tests of the host-tax split (``bench/host_tax.py``): its rules on a made-up trace, and the
bench column on a real short run in a fake world of 2."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from bench.host_tax import BUCKETS, HOST_BUCKETS, STEP_EVENT, applies_to, split_events
from bench.report import host_tax_cell
from bench.step import main
from bench.trace_split import KINDS, callers, chrome_events, kind_of, work_split


@dataclass
class _Event:
    """The four methods of a kineto event the split reads (times in microseconds here)."""

    label: str
    start: int
    stop: int
    thread: int = 1

    def name(self) -> str:
        return self.label

    def start_ns(self) -> int:
        return self.start * 1000

    def duration_ns(self) -> int:
        return (self.stop - self.start) * 1000

    def start_thread_id(self) -> int:
        return self.thread


def _us(split: dict) -> dict[str, float]:
    return {b: round(split[f"{b}_s"] * 1e6, 6) for b in BUCKETS}


def test_split_follows_the_innermost_event_and_sums_to_the_step():
    events = [
        _Event(STEP_EVENT, 0, 100),
        _Event("TorchDynamo Cache Lookup", 1, 4),  # guards 3
        _Event("Torch-Compiled Region: 0/0", 4, 30),  # own time: wrappers
        _Event("Pregraph bytecode", 5, 6),  # wrappers 1
        _Event("CompiledFunction", 6, 20),
        _Event("## Call CompiledFxGraph abc ##", 7, 18),  # compiled 11
        _Event("aten::mm", 8, 12),  # inside the graph: compiled
        _Event("aten::copy_", 22, 25),  # eager code the frame runs (graph break): rest 3
        _Event("aten::ones_like", 31, 32),  # rest 1
        _Event("autograd::engine::evaluate_function: CompiledFunctionBackward", 33, 60),
        _Event("CompiledFunctionBackward", 34, 59),
        _Event("## Call CompiledFxGraph def ##", 36, 56),  # compiled 20
        _Event("Optimizer.step#AdamW.step", 62, 90),
        _Event("aten::mul_", 63, 73),
        _Event("PythonSubclass", 63, 73),  # subclass, 6 of it its own
        _Event("aten::mul_", 65, 69),
        _Event("bench::sync", 95, 97),  # wait 2
    ]
    (split,) = split_events(events)
    assert split["step_s"] == pytest.approx(100e-6)
    assert _us(split) == {
        "compiled": 11 + 20,
        "guards": 3,
        # region 4-30 less its children (1 + 14 + 3) = 8; CompiledFunction 14 - 11 = 3;
        # pregraph 1; the backward's node 27 - 20 = 7
        "wrappers": 8 + 3 + 1 + 7,
        "optimizer": 28,
        "wait": 2,
        "rest": 100 - 31 - 3 - 19 - 28 - 2,
    }
    assert split["host_s"] == pytest.approx(sum(split[f"{b}_s"] for b in HOST_BUCKETS))
    assert split["subclass_s"] == pytest.approx(6e-6)
    assert split["subclass_by_bucket"]["optimizer"] == pytest.approx(6e-6)


def test_work_split_gives_each_instant_of_the_step_to_its_innermost_event():
    """bench.trace_split: self times on the step's thread, by kind of work; another thread's
    events and events outside a step are not counted; the kernels ranked by time."""
    events = [
        _Event(STEP_EVENT, 0, 100),
        _Event("## Call CompiledFxGraph abc ##", 2, 60),  # own time 58-10-20-5-8-4 = 11
        _Event("aten::mm", 4, 14),  # matmul 10
        _Event("cpp_fused_add_1", 14, 34),  # inductor kernels 20
        _Event("aten::_scaled_dot_product_flash_attention_for_cpu", 34, 39),  # attention 5
        _Event("graphshard::all_gather_single", 40, 48),  # comm issue 8 ...
        _Event("c10d::_allgather_base_", 41, 43),  # ... with the collective inside it
        _Event("_c10d_functional::wait_tensor", 50, 54),  # comm wait 4
        _Event("Optimizer.step#AdamW.step", 62, 90),  # optimizer 28 - 6 = 22
        _Event("aten::_fused_adamw_", 64, 70),  # optimizer 6
        _Event("cpp_fused_add_1", 200, 210),  # after the step: not counted
        _Event("aten::mm", 5, 95, thread=2),  # another thread: not counted
        _Event(STEP_EVENT, 300, 340),
        _Event("cpp_fused_copy_2", 310, 340),  # inductor kernels 30, other 10
    ]
    work = work_split(events, top_events=3)
    assert work["steps"] == 2 and work["step_ms"] == pytest.approx(70e-3)
    assert {k: round(work[f"{k}_ms"] * 2e3, 6) for k in KINDS} == {
        "matmul": 10, "attention": 5, "inductor kernels": 61, "comm issue": 8,
        "comm wait": 4, "optimizer": 28, "other": 24}
    assert [(name, round(ms * 2e3, 6), calls) for name, ms, calls in work["kernels"]] == [
        ("cpp_fused_copy_2", 30, 0.5), ("cpp_fused_add_1", 20, 0.5)]
    # Every name ranked by its self time, of any kind (the steps' own: 100-58-28 + 40-30).
    assert [(kind, name, round(ms * 2e3, 6), calls)
            for kind, name, ms, calls in work["events"]] == [
        ("inductor kernels", "cpp_fused_copy_2", 30, 0.5), ("other", STEP_EVENT, 24, 1),
        ("optimizer", "Optimizer.step#AdamW.step", 22, 0.5)]
    # Where an event is called from: its enclosing events, inside the steps only.
    assert callers(events, "c10d::_allgather_base_") == [
        ("## Call CompiledFxGraph abc ## > graphshard::all_gather_single", pytest.approx(1e-3),
         0.5)]
    assert [(where, round(ms * 2e3, 6), calls) for where, ms, calls in
            callers(events, "aten::mm", depth=1)] == [("## Call CompiledFxGraph abc ##", 10, 0.5)]
    assert callers([], "aten::mm") == []
    assert kind_of("graph_0_cpp_fused_mul_silu_4") == "inductor kernels"  # DDP's split graphs
    assert kind_of("graphshard::take_prefetched") == "comm wait"
    assert work_split([])["steps"] == 0


def test_a_chrome_trace_gives_its_host_events_only(tmp_path):
    """bench.trace_split.chrome_events: the device's timeline (kernels, the step range the
    profiler draws there too) is left out, so a GPU trace counts each step once."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": STEP_EVENT, "ts": 0, "dur": 10, "tid": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 4, "tid": 1},
        {"ph": "X", "cat": "gpu_user_annotation", "name": STEP_EVENT, "ts": 2, "dur": 9,
         "tid": 7},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 3, "dur": 5, "tid": 7},
        {"ph": "M", "name": "thread_name", "tid": "PyTorch Profiler"},
    ]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert [e.name() for e in chrome_events(str(path))] == [STEP_EVENT, "aten::mm"]
    work = work_split(chrome_events(str(path)))
    assert work["steps"] == 1 and work["matmul_ms"] == pytest.approx(4e-3)
    assert work["other_ms"] == pytest.approx(6e-3)


def test_another_threads_backward_fills_the_callers_wait():
    """On a GPU the autograd engine runs the backward on its device thread while the
    caller waits in ``backward()``: that time is the other thread's bucket, once."""
    events = [
        _Event(STEP_EVENT, 0, 50),
        _Event("autograd::engine::evaluate_function: CompiledFunctionBackward", 10, 40, 2),
        _Event("CompiledFunctionBackward", 10, 40, 2),
        _Event("## Call CompiledFxGraph k ##", 15, 35, 2),
        _Event("aten::add", 12, 13, 3),  # another thread, no bucket: stays rest
        _Event("Optimizer.step#SGD.step", 42, 48),
    ]
    (split,) = split_events(events)
    assert _us(split) == {"compiled": 20, "guards": 0, "wrappers": 10, "optimizer": 6,
                          "wait": 0, "rest": 14}


def test_a_step_per_step_event_and_the_eager_systems_left_out():
    events = [_Event(STEP_EVENT, 0, 10), _Event(STEP_EVENT, 20, 25),
              _Event("Optimizer.step#AdamW.step", 21, 24)]
    first, second = split_events(events)
    assert first["rest_s"] == pytest.approx(10e-6)
    assert second["optimizer_s"] == pytest.approx(3e-6)
    assert applies_to("graphshard-compiled[bucketing=size]") and applies_to("ddp-compiled")
    assert not applies_to("graphshard-eager") and not applies_to("fsdp2-prefetch-eager")
    assert host_tax_cell(None) == "n/a"


@pytest.mark.timeout(180)
def test_bench_column_splits_a_real_step(tmp_path):
    """A fake world of 2, tiny model: the compiled systems' steps split into non-negative
    parts that sum to the profiled step, with guards, wrappers and the optimizer nonzero;
    the eager system has no split."""
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    traces = tmp_path / "traces"
    main(["--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--fake-world", "2",
          "--steps", "3", "--warmup", "1", "--host-tax-steps", "2", "--json", str(out),
          "--markdown", str(md), "--trace-dir", str(traces), "--systems", "graphshard-compiled",
          "graphshard-eager", "single-compiled"])
    systems = {s["system"]: s for s in json.loads(out.read_text())["systems"]}
    assert systems["graphshard-eager"]["host_tax"] is None
    for name in ("graphshard-compiled", "single-compiled"):
        split = systems[name]["host_tax"]
        assert split["steps"] == 2, name
        parts = [split[f"{b}_s"] for b in BUCKETS]
        assert min(parts) >= 0, (name, split)
        assert sum(parts) == pytest.approx(split["step_s"], rel=1e-6), (name, split)
        for bucket in ("compiled", "guards", "wrappers", "optimizer"):
            assert split[f"{bucket}_s"] > 0, (name, bucket, split)
        assert 0 < split["host_s"] < split["step_s"]
    # DTensor parameters: AdamW's ops go through DTensor's dispatch; plain ones do not
    assert systems["graphshard-compiled"]["host_tax"]["subclass_by_bucket"]["optimizer"] > 0
    assert systems["single-compiled"]["host_tax"]["subclass_s"] == 0
    table = md.read_text()
    assert "host ms: guards / wrappers / optimizer / rest" in table
    # --trace-dir: the same profiled steps as Chrome traces, which bench.trace_split splits
    # by kind of work (the eager system has no host-tax profile, so no trace)
    assert sorted(p.name for p in traces.iterdir()) == [
        "graphshard-compiled.rank0.json", "single-compiled.rank0.json"]
    for name in ("graphshard-compiled", "single-compiled"):
        work = work_split(chrome_events(str(traces / f"{name}.rank0.json")))
        assert work["steps"] == 2, (name, work)
        assert sum(work[f"{k}_ms"] for k in KINDS) == pytest.approx(work["step_ms"], rel=1e-6)
        assert work["matmul_ms"] > 0 and work["inductor kernels_ms"] > 0, (name, work)
        assert work["optimizer_ms"] > 0, (name, work)
        # the profiled step of the trace is the one the host-tax split measured
        profiled = systems[name]["host_tax"]["step_s_all"]
        assert work["step_ms"] == pytest.approx(1e3 * sum(profiled) / 2, rel=1e-3)
    row = next(line for line in table.splitlines() if line.startswith("| graphshard-compiled "))
    assert row.endswith(f"| {host_tax_cell(systems['graphshard-compiled']['host_tax'])} |")


@dataclass
class _DeviceEvent(_Event):
    """A kineto event with its device: CPU for host events, CUDA for device activity."""

    on_device: bool = False

    def device_type(self):
        kinds = torch.autograd.DeviceType
        return kinds.CUDA if self.on_device else kinds.CPU


def test_device_time_counts_overlapping_activity_once_and_ranks_the_kernels():
    from bench.device_time import device_split
    from bench.report import device_time_lines

    events = [
        _DeviceEvent(STEP_EVENT, 0, 100),
        _DeviceEvent("aten::mm", 1, 2),  # host op: not device time
        _DeviceEvent("gemm", 10, 30, on_device=True),
        _DeviceEvent("copy_kernel", 20, 40, on_device=True),  # overlaps gemm: busy 10..40
        _DeviceEvent("Memcpy HtoD (Pinned -> Device)", 50, 55, on_device=True),
        _DeviceEvent("gemm", 60, 70, on_device=True),
        _DeviceEvent(STEP_EVENT, 12, 70, on_device=True),  # the range drawn on the device
        _DeviceEvent(STEP_EVENT, 200, 260),
        _DeviceEvent("gemm", 210, 220, on_device=True),
        _DeviceEvent("gemm", 300, 310, on_device=True),  # after every step: no step's
    ]
    first, second = device_split(events)
    assert round(first["busy_s"] * 1e6) == 45  # 10..40, 50..55, 60..70
    assert round(first["idle_s"] * 1e6) == 55
    assert round(first["kernel_s"] * 1e6) == 50 and round(first["copy_s"] * 1e6) == 5
    assert first["kernels"] == 3
    assert [(name, count) for name, _, count in first["top"]] == [("gemm", 2), ("copy_kernel", 1)]
    assert {f: n for f, (_, n) in first["families"].items()} == {"gemm": 2, "other": 1}
    assert round(second["busy_s"] * 1e6) == 10 and second["kernels"] == 1

    record = {"system": "graphshard-compiled", "device_time": {**first, "steps": 2}}
    table = "\n".join(device_time_lines([record, {"system": "fsdp2-eager"}]))
    assert "| graphshard-compiled | 0.1 | 0.0 | 0.1 | 3 |" in table and "`gemm`" in table
    assert "- graphshard-compiled: gemm 2 (0.0), other 1 (0.0)" in table
    assert "fsdp2-eager" not in table
    assert device_time_lines([{"system": "x"}]) == []
