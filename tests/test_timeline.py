"""Chrome trace export and PNG rendering of a hand-built timeline."""

from __future__ import annotations

import json

from graphshard.analysis.timeline import event_label, render_png, to_chrome_trace, write_trace
from graphshard.passes.simulate import Event, Timeline


def _timeline() -> Timeline:
    events = [
        Event("all_gather_into_tensor", "comm", 0.0, 2e-3, 0, "unshard"),
        Event("wait all_gather_into_tensor", "compute", 0.0, 2e-3, 0, "exposed"),
        Event("mm (+3 ops)", "compute", 2e-3, 7e-3, None, "compute", 4, 10**9),
        Event("all_gather_into_tensor_1", "comm", 2e-3, 4e-3, 1, "unshard"),
        Event("reduce_scatter_tensor", "comm", 7e-3, 9e-3, 1, "reduce_grad"),
        Event("wait reduce_scatter_tensor", "compute", 7e-3, 9e-3, 1, "exposed"),
    ]
    return Timeline(
        events,
        total_time=9e-3,
        compute_time=5e-3,
        comm_time=6e-3,
        exposed_comm=4e-3,
        peak_unsharded_bytes=1 << 20,
        profile="test",
    )


def test_chrome_trace_is_valid_json_with_lanes():
    trace = json.loads(json.dumps(to_chrome_trace(_timeline(), name="step")))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 6
    assert all({"ts", "dur", "tid", "pid"} <= e.keys() for e in spans)
    lanes = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"
    }
    assert set(lanes.values()) == {"compute", "comm", "exposed"}
    by_name = {e["name"]: e for e in spans}
    assert by_name["AG1"]["ts"] == 2000.0 and by_name["AG1"]["dur"] == 2000.0
    assert lanes[by_name["RS1"]["tid"]] == "comm" and by_name["RS1"]["args"]["bucket"] == 1
    exposed = [e for e in spans if e["args"]["kind"] == "exposed"]
    assert len(exposed) == 2 and all(lanes[e["tid"]] == "exposed" for e in exposed)


def test_write_trace(tmp_path):
    path = write_trace(_timeline(), tmp_path / "trace.json")
    assert json.loads(path.read_text())["otherData"]["exposed_comm_s"] == 4e-3


def test_event_labels():
    ag, _, mm, _, rs, _ = _timeline().events
    assert (event_label(ag), event_label(rs), event_label(mm)) == ("AG0", "RS1", "mm (+3 ops)")
    assert event_label(Event("all_reduce", "comm", 0, 1, None, "all_reduce")) == "AR"


def test_render_png(tmp_path):
    path = render_png(_timeline(), tmp_path / "timeline.png", title="test step")
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
