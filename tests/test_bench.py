"""Smoke test of the step benchmark (``python -m bench.step``) on two gloo ranks."""

from __future__ import annotations

import json

import pytest

from bench.step import FIELDS, main, summarize

SYSTEMS = ["graphshard-compiled", "graphshard-eager", "fsdp2-eager", "ddp-compiled"]


@pytest.mark.timeout(400)
def test_bench_tiny_two_ranks(tmp_path, capsys):
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    main(
        [
            "--world-size", "2", "--model", "tiny", "--steps", "2", "--warmup", "1",
            "--seq-len", "16", "--batch-size", "2", "--json", str(out),
            "--markdown", str(md), "--systems", *SYSTEMS,
        ]
    )
    report = json.loads(out.read_text())
    assert {"platform", "cpu_count", "torch", "device_name"} <= set(report["machine"])
    assert report["config"]["world_size"] == 2
    systems = {s["system"]: s for s in report["systems"]}
    assert list(systems) == SYSTEMS
    for s in systems.values():
        assert set(FIELDS) <= set(s), s["system"]
        assert s["step_s_median"] > 0 and s["step_s_p90"] >= s["step_s_median"], s
        assert s["peak_mem_bytes"] > 0, s
        assert s["final_loss"] is not None, s
    gs = systems["graphshard-compiled"]
    assert isinstance(gs["bytes_per_step"], int) and gs["bytes_per_step"] > 0
    assert gs["collectives_per_step"] > 0 and gs["predicted_step_s"] > 0
    # Same init, same batches, gradients averaged over ranks: the losses agree.
    losses = [s["final_loss"] for s in systems.values()]
    assert max(losses) - min(losses) < 1e-3 * abs(losses[0]), losses
    table = md.read_text()
    assert all(name in table for name in SYSTEMS)
    assert table in capsys.readouterr().out


def test_failed_system_has_null_numbers_and_the_error():
    record = summarize("fsdp2-eager", [{"error": "RuntimeError: boom"}, {"idle": True}], 1)
    assert set(FIELDS) <= set(record)
    assert record["step_s_median"] is None and record["bytes_per_step"] is None
    assert "rank 0: RuntimeError: boom" in record["notes"]
