"""graphshard plan: fake-tensor what-if at several world sizes; bytes match the formula."""

from __future__ import annotations

import json

import torch

from graphshard.models.llama import Llama, llama_config
from graphshard.tools.cli import main


def test_plan_bytes_and_state_match_the_formula(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "tiny", "--world-size", "2,4", "--seq-len", "32", "--symbolic",
            "--profile", "h100-infiniband", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "bytes per rank and step = (N - 1)" in printed
    assert "| copies GiB (floor) |" in printed
    rows = json.loads(out.read_text())
    cfg = llama_config("tiny")
    model = Llama(cfg)
    psi = sum(p.numel() for p in model.parameters())
    # Every dim 0 of tiny divides 2 and 4 (no padding). The backward gathers everything again
    # but the bucket read last in forward, kept for the backward that starts with it (the
    # final norm and output), and the embedding, whose gradient needs no weights.
    root = [model.tok_embeddings, model.norm, model.output]
    psi_bw = psi - sum(p.numel() for m in root for p in m.parameters())
    for row in rows:
        n = row["world_size"]
        assert row["params"] == psi
        assert row["params_regathered"] == psi_bw
        assert row["bytes_per_step"] == (n - 1) * 4 * (psi + psi_bw + psi) // n
        # No tensor parallelism: all of it is dp traffic.
        assert (row["dp"], row["tp"], row["tp_bytes_per_step"], row["tp_comm_s"]) == (n, 1, 0, 0)
        assert row["dp_bytes_per_step"] == row["bytes_per_step"]
        assert (row["model_params"], row["tp_split_params"]) == (psi, 0)
        assert row["sharded_params"] == psi * 4 // n
        assert row["memory_total"] >= 4 * row["sharded_params"]
        assert row["predicted_step_s"] >= row["bound_s"] > 0
        assert row["buckets"] == cfg.n_layers + 2  # the blocks, the embedding, the head
        # tiny at N = 2, 4 pads nothing, and every cut is made: graphshard's own kernels move
        # what the floor asks, which is at least each shard read and the buffer written once
        # per gather, and each gradient read and the reduce buffer written once
        assert row["copy_bytes"] == row["copy_floor_bytes"]
        assert row["copy_bytes"] >= (psi + psi_bw + psi) * 4 // n + (2 * psi + psi_bw) * 4
    assert rows[1]["bytes_per_step"] > rows[0]["bytes_per_step"]  # (N-1)/N grows with N
    assert torch.distributed.is_initialized() is False


def test_kept_parameters_are_not_counted_as_activations(tmp_path):
    from graphshard.tools.whatif import llama_factory, what_if

    factory = llama_factory("tiny", 1, 16)
    kept = what_if(factory, 2, profile="cpu-gloo")
    freed = what_if(factory, 2, profile="cpu-gloo", reshard_last_bucket=True)
    assert kept.params_regathered < freed.params_regathered
    assert kept.activations == freed.activations


class _Adapted(torch.nn.Module):
    """A frozen base layer under a trainable head, in one bucket (as a fine-tune with
    adapters has): the frozen bias lies at an offset in the bucket's buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(8, 16)
        self.base.requires_grad_(False)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.relu(self.base(x))).sum()


def _adapted():
    return _Adapted(), (torch.randn(4, 8),)


def test_frozen_parameters_trace_and_take_no_gradient_traffic_or_state(capsys):
    """A frozen parameter's DTensor, read as it is, once failed the fake-tensor trace (its
    local tensor a view at an offset in the bucket's buffer); and it was counted with a
    reduce-scatter's worth of gradient and Adam state it never has."""
    from graphshard.tools.whatif import symbolic_report, what_if

    rows = [what_if(_adapted, n, profile="cpu-gloo") for n in (2, 4)]
    psi, psi_g = 16 * 8 + 16 + 4 * 16 + 4, 4 * 16 + 4
    for row in rows:
        n = row.world_size
        assert (row.params, row.params_trained, row.buckets) == (psi, psi_g, 1)
        # one bucket, read last in forward and kept: gathered once, its trained part reduced
        assert row.bytes_per_step == (n - 1) * 4 * (psi + psi_g) // n
        assert row.grads == 4 * psi_g // n and row.adam_state == 2 * row.grads
        assert row.sharded_params == 4 * psi // n
    report = symbolic_report(rows)
    assert "Psi_g*b_reduce" in report
    for line in report.splitlines()[-2:]:  # formula and graph agree, bytes and state
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[3] == cells[4] and cells[6] == cells[7], line


def test_reshard_to_groups_of_a_node_prices_the_backward_on_the_node(tmp_path):
    """``--reshard-after-forward 8`` at 16 ranks on ``h100-cluster`` (nodes of 8): the
    backward's gathers run within a node, over NVLink instead of InfiniBand, so the step's
    communication takes less time than with ``true``; between forward and backward each
    rank keeps an eighth of the parameters the backward reads, besides its shard."""
    rows = {}
    for reshard in ("true", "8", "false"):
        out = tmp_path / f"{reshard}.json"
        assert main(["plan", "--model", "tiny", "--world-size", "16", "--seq-len", "32",
                     "--profile", "h100-cluster", "--reshard-after-forward", reshard,
                     "--json", str(out)]) == 0
        (rows[reshard],) = json.loads(out.read_text())
    assert rows["false"]["comm_s"] < rows["8"]["comm_s"] < rows["true"]["comm_s"]
    assert rows["8"]["params_regathered"] == rows["true"]["params_regathered"]
    # the pieces the forward keeps (counted with the activations it saves): fp32, 1/8 each
    kept = rows["8"]["activations"] - rows["true"]["activations"]
    assert kept == rows["true"]["params_regathered"] * 4 // 8
    assert rows["8"]["memory_total"] < rows["false"]["memory_total"]


def test_reshard_after_forward_and_memory_budget_are_refused_together():
    import pytest

    with pytest.raises(SystemExit, match="leave --reshard-after-forward out"):
        main(["plan", "--model", "tiny", "--world-size", "8", "--memory-budget", "1GiB",
              "--reshard-after-forward", "8"])
