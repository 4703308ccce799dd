"""``examples/train_llama.py --tp``: dp 2 x tp 2 on 4 gloo ranks trains exactly like dp 2
without tensor parallelism on 2 ranks (same seed, same batch per data-parallel rank), eager,
compiled (from a meta-device model), resumed from a checkpoint, and in bf16; a ``--tp`` that
does not divide the ranks or the model is refused before anything is built."""

from __future__ import annotations

import math

import pytest
import torch
from dist_utils import example_ranks

# a small clipping threshold: every step clips, so the norm over the two meshes' gradients
# (TP-split on (dp, tp), the rest on dp) must be the dp-only run's
COMMON = ("--model", "tiny", "--seq-len", "16", "--batch-size", "2", "--steps", "3",
          "--clip-grad-norm", "0.05", "--timeout-s", "60")
# bf16 with no_sync micro-batches; a higher learning rate: the loss visibly falls in 3 steps
BF16 = ("--eager", "--mixed-precision", "bf16", "--grad-accum", "2", "--lr", "1e-2",
        "--warmup-steps", "0")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every rank's final loss and the saved full state dict of each configuration, all
    in one launch of 4 ranks: dp 2 (on ranks 0 and 1) and dp 2 x tp 2."""
    tmp = tmp_path_factory.mktemp("tp_example")

    def argv(name: str, *extra: str) -> list[str]:
        return [*COMMON, "--save", str(tmp / f"{name}.pt"), *extra]

    configs = {
        "dp": (2, argv("dp", "--eager")),
        "dp_bf16": (2, argv("dp_bf16", *BF16)),
        "tp_eager": (4, argv("tp_eager", "--tp", "2", "--eager")),
        "tp_compiled": (4, argv("tp_compiled", "--tp", "2", "--meta-init")),
        # 2 steps and a checkpoint, then the 3rd after --resume
        "tp_first": (4, [*COMMON, "--steps", "2", "--tp", "2", "--eager",
                         "--checkpoint-dir", str(tmp / "ck")]),
        "tp_resumed": (4, argv("tp_resumed", "--tp", "2", "--eager",
                               "--checkpoint-dir", str(tmp / "ck"), "--resume")),
        "tp_bf16": (4, argv("tp_bf16", "--tp", "2", *BF16)),
    }
    per_rank = example_ranks(*configs.values())
    out = {}
    for i, (name, (world, _)) in enumerate(configs.items()):
        saved = tmp / f"{name}.pt"
        out[name] = {"losses": [losses[i] for losses in per_rank[:world]],
                     "state": torch.load(saved) if saved.exists() else None}
    return out


@pytest.mark.parametrize("name", ["tp_eager", "tp_compiled", "tp_resumed"])
def test_dp_by_tp_trains_like_dp_alone(runs, name):
    """Same loss (the mean over the 2 data-parallel ranks, on every rank) and same trained
    weights as the dp-only run."""
    want, got = runs["dp"], runs[name]
    assert len(set(want["losses"])) == 1
    assert got["losses"] == pytest.approx(want["losses"][:1] * 4, rel=1e-5)
    assert got["state"].keys() == want["state"].keys()
    for key, value in want["state"].items():
        torch.testing.assert_close(got["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_bf16_dp_by_tp_learns_like_bf16_dp(runs):
    """The loss falls and matches bf16 dp-only within bf16 rounding (weights are not
    compared: Adam turns rounding-sized gradient differences into learning-rate-sized
    steps)."""
    want, got = runs["dp_bf16"], runs["tp_bf16"]
    assert got["losses"] == pytest.approx(want["losses"][:1] * 4, rel=2e-3)
    assert got["losses"][0] < math.log(256) - 0.1  # the uniform guess; it starts above
    assert got["state"].keys() == want["state"].keys()


def _example():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "train_llama_example", Path(__file__).parents[1] / "examples" / "train_llama.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mesh_layouts_and_refusals():
    from graphshard.models.llama import check_tensor_parallel, llama_config

    example = _example()
    assert example.mesh_layout(4, 1, 2) == ((2, 2), ("dp", "tp"))
    assert example.mesh_layout(8, 2, 2) == ((2, 2, 2), ("replicate", "shard", "tp"))
    assert example.mesh_layout(4, 2, 1) == ((2, 2), ("replicate", "shard"))
    assert example.mesh_layout(4, 1, 1) == ((4,), ("dp",))
    with pytest.raises(SystemExit, match="--tp 3 does not divide the 4 ranks"):
        example.mesh_layout(4, 1, 3)
    with pytest.raises(SystemExit, match="--replicas 3 does not divide the 2 data-parallel"):
        example.mesh_layout(4, 3, 2)
    check_tensor_parallel(llama_config("tiny"), 2)
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be divisible by tp"):
        check_tensor_parallel(llama_config("tiny"), 3)
    with pytest.raises(ValueError, match=r"n_kv_heads \(2\) must be divisible by tp"):
        check_tensor_parallel(llama_config("tiny"), 4)
    with pytest.raises(SystemExit):
        example.parse_args(["--tp", "0"])
