"""graphshard plan / dump with --tp: a (dp, tp) mesh of fake ranks, bytes per mesh dimension."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from graphshard.models.llama import Llama, llama_config, tensor_parallel_plan
from graphshard.passes.cost_model import all_reduce_time, collective_bytes_per_rank, get_profile
from graphshard.tools.cli import main

c10d = torch.ops._c10d_functional

TP_FACTORY = '''
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

def build():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
                            for _ in range(2)])
    plan = {}
    for i in range(2):
        plan[f"{i}.0"] = ColwiseParallel()
        plan[f"{i}.2"] = RowwiseParallel()
    return model, (torch.randn(4, 64),), plan

def build_without_plan():
    return build()[:2]
'''


def test_tp_plan_counts_dp_and_tp_bytes_and_memory(tmp_path):
    """tiny at world 8 = (dp, tp) (4, 2), through the CLI: every number by hand."""
    out = tmp_path / "plan.json"
    batch, seq, dp, tp = 1, 32, 4, 2
    argv = ["plan", "--model", "tiny", "--world-size", str(dp * tp), "--tp", str(tp),
            "--seq-len", str(seq), "--batch-size", str(batch), "--profile", "h100-infiniband",
            "--json", str(out), "--jobs", "1"]
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())
    cfg = llama_config("tiny")
    model = Llama(cfg)
    split = {f"{name}.weight" for name in tensor_parallel_plan(model)}  # all bias-free linears
    psi = sum(p.numel() for p in model.parameters())
    psi_split = sum(p.numel() for n, p in model.named_parameters() if n in split)
    psi_local = psi - psi_split + psi_split // tp  # what one tp rank holds
    # The root bucket (embedding, final norm, output: none of them split) is read last in
    # forward and kept for backward: the backward gathers everything else again.
    root = sum(p.numel() for m in (model.tok_embeddings, model.norm, model.output)
               for p in m.parameters())
    psi_bw = psi_local - root
    assert (row["world_size"], row["dp"], row["tp"]) == (8, dp, tp)
    assert (row["model_params"], row["tp_split_params"]) == (psi, psi_split)
    assert (row["params"], row["params_regathered"]) == (psi_local, psi_bw)
    # Every dim 0 of tiny, also split over tp, divides by dp = 4: no padding.
    assert row["sharded_params"] == row["grads"] == psi_local * 4 // dp
    assert row["adam_state"] == 2 * row["sharded_params"]
    # dp: all-gathers in forward and backward, a reduce-scatter, each (dp-1)/dp on a ring.
    assert row["dp_bytes_per_step"] == (dp - 1) * 4 * (psi_local + psi_bw + psi_local) // dp
    # tp: per layer, forward all-reduces the outputs of wo and w2 (RowwiseParallel); backward
    # all-reduces the input gradients of q, k, v, w1 and w3 (each ColwiseParallel module its
    # own): 7 all-reduces of batch x seq x dim fp32, each 2(tp-1)/tp of it per rank.
    activation = batch * seq * cfg.dim * 4
    all_reduces = cfg.n_layers * (2 + 5)
    assert row["tp_bytes_per_step"] == all_reduces * 2 * (tp - 1) * activation // tp
    assert row["bytes_per_step"] == row["dp_bytes_per_step"] + row["tp_bytes_per_step"]
    profile = get_profile("h100-infiniband")
    assert row["tp_comm_s"] == pytest.approx(all_reduces * all_reduce_time(activation, tp, profile))
    assert row["comm_s"] > row["tp_comm_s"] > 0
    assert row["predicted_step_s"] >= row["bound_s"] > 0
    assert dist.is_initialized() is False


def test_tp_must_divide_the_world_size(tmp_path):
    with pytest.raises(ValueError, match=r"tp \(4\) must divide the world size \(6\)"):
        main(["plan", "--model", "tiny", "--world-size", "8,6", "--tp", "4"])
    with pytest.raises(ValueError, match="must divide"):
        main(["dump", "x:build", "--world-size", "6", "--tp", "4", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"n_kv_heads \(2\) must be divisible by tp"):
        main(["plan", "--model", "tiny", "--world-size", "8", "--tp", "4"])  # 4 heads, 2 kv


def test_tp_needs_a_plan_from_the_factory(tmp_path, monkeypatch):
    (tmp_path / "tp_models.py").write_text(TP_FACTORY)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"return \(model, inputs, tp_plan\)"):
        main(["dump", "tp_models:build_without_plan", "--world-size", "4", "--tp", "2",
              "--out", str(tmp_path / "out")])
    assert dist.is_initialized() is False


def _collective_groups(text: str, op: str) -> set[str]:
    """Group names (the last argument) of ``op`` calls in a dumped graph."""
    return set(re.findall(rf"{op}\.default\([^\n]*'(\w+)'\)", text))


def test_dump_tp_writes_graphs_with_dp_and_tp_collectives(tmp_path, monkeypatch, capsys):
    (tmp_path / "tp_models.py").write_text(TP_FACTORY)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    assert main(["dump", "tp_models:build", "--world-size", "4", "--tp", "2",
                 "--out", str(out)]) == 0
    assert "at world size 4 ((dp, tp) = (2, 2))" in capsys.readouterr().out
    (graph_dir,) = (out / "rank0").iterdir()
    # numbered by position in the pipeline
    (fw_file,) = graph_dir.glob("fw_[0-9][0-9]_prefetch.txt")
    (bw_file,) = graph_dir.glob("bw_[0-9][0-9]_overlap_reduce.txt")
    fw, bw = fw_file.read_text(), bw_file.read_text()
    for name in ("fw_schedule.txt", "bw_schedule.txt", "fw_timeline.png", "bw_timeline.json"):
        assert (graph_dir / name).is_file(), name
    dp_groups = _collective_groups(fw + bw, "all_gather_into_tensor")
    assert dp_groups == _collective_groups(bw, "reduce_scatter_tensor")
    tp_groups = _collective_groups(fw, "all_reduce") | _collective_groups(bw, "all_reduce")
    assert len(dp_groups) == len(tp_groups) == 1 and dp_groups != tp_groups
    # Forward: each block's RowwiseParallel output; backward: the ColwiseParallel input
    # gradient of block 1 (block 0's input, the data, needs none).
    assert (fw.count("all_reduce.default("), bw.count("all_reduce.default(")) == (2, 1)


@pytest.fixture()
def group4():
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


def test_ring_bytes_per_rank_of_each_collective(group4):
    def fn(x):
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(x, 4, group4))
        scattered = c10d.wait_tensor(c10d.reduce_scatter_tensor(gathered, "sum", 4, group4))
        summed = c10d.wait_tensor(c10d.all_reduce(scattered, "sum", group4))
        return c10d.wait_tensor(c10d.all_to_all_single(summed, [64] * 4, [64] * 4, group4))

    gm = make_fx(fn, tracing_mode="fake")(torch.randn(256))
    nodes = {str(n.target).split(".")[1]: n for n in gm.graph.nodes
             if "c10d" in str(n.target) and "wait" not in str(n.target)}
    full = 1024 * 4  # bytes of the gathered tensor
    assert collective_bytes_per_rank(nodes["all_gather_into_tensor"]) == 3 / 4 * full
    assert collective_bytes_per_rank(nodes["reduce_scatter_tensor"]) == 3 / 4 * full
    with pytest.raises(ValueError, match="group size"):  # an all-reduce does not say it
        collective_bytes_per_rank(nodes["all_reduce"])
    assert collective_bytes_per_rank(nodes["all_reduce"], 4) == 2 * 3 / 4 * 256 * 4
    nodes["all_to_all_single"].meta["group_size"] = 4  # what the backend records
    assert collective_bytes_per_rank(nodes["all_to_all_single"]) == 3 / 4 * 256 * 4
