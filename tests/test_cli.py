"""The graphshard command: offline dump with fake ranks, and calibration."""

from __future__ import annotations

import json

import pytest

from graphshard.passes.cost_model import get_profile
from graphshard.tools.cli import main
from graphshard.tools.offline import load_factory

FACTORY = '''
import torch
from torch import nn

def build():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU()) for _ in range(3)])
    return model, (torch.randn(4, 64),)
'''


def test_dump_traces_offline_and_writes_everything(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_models.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert main(["dump", "my_models:build", "--world-size", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "traced 1 graph(s) at world size 8" in printed
    (graph_dir,) = (out / "rank0").iterdir()  # graph ids count per process
    names = ("fw_schedule.txt", "bw_schedule.txt", "fw_timeline.png", "bw_01_lower_unshard.txt")
    for name in names:
        assert (graph_dir / name).is_file(), name
    trace = json.loads((graph_dir / "bw_timeline.json").read_text())
    kinds = {e.get("args", {}).get("kind") for e in trace["traceEvents"]}
    assert {"unshard", "reduce_grad", "compute"} <= kinds
    table = (graph_dir / "fw_schedule.txt").read_text()
    # 3 blocks, world 8: each bucket gathers 64*64+64 floats (64 rows divide by 8)
    assert table.count("all_gather") == 3
    assert f"{(64 * 64 + 64) * 4:,}" in table
    assert "all_gather_into_tensor_coalesced" not in \
        (graph_dir / "fw_02_lower_unshard.txt").read_text()
    # the same through coalesced collectives: the same buckets and bytes, no flat buffer
    coalesced = tmp_path / "coalesced"
    assert main(["dump", "my_models:build", "--world-size", "8", "--out", str(coalesced),
                 "--all-gather-via", "coalesced", "--reduce-scatter-via", "coalesced"]) == 0
    (graph_dir,) = (coalesced / "rank0").iterdir()
    table = (graph_dir / "fw_schedule.txt").read_text()
    assert table.count("all_gather") == 3 and f"{(64 * 64 + 64) * 4:,}" in table
    assert (graph_dir / "fw_02_lower_unshard.txt").read_text().count(
        "ops._c10d_functional.all_gather_into_tensor_coalesced") == 3
    assert "ops._c10d_functional.reduce_scatter_tensor_coalesced" in \
        (graph_dir / "bw_03_lower_reduce_grad.txt").read_text()


def test_load_factory_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="MODULE:FACTORY"):
        load_factory("no_colon")
    (tmp_path / "m.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="no function 'build'"):
        load_factory("m.py:build")


def test_calibrate_saves_a_profile_the_cost_model_uses(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GRAPHSHARD_PROFILE_DIR", str(tmp_path))
    assert main(["calibrate", "--name", "cpu-test", "--bytes", str(2**20)]) == 0
    assert (tmp_path / "cpu-test.json").is_file()
    profile = get_profile("cpu-test")
    assert profile.source.startswith("measured by graphshard calibrate")
    assert profile.alpha_s > 0 and profile.bandwidth_Bps > 0 and profile.peak_flops > 0
    assert "saved profile 'cpu-test'" in capsys.readouterr().out
