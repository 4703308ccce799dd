"""Hugging Face architectures unlike Llama, sharded with the defaults on 2 gloo ranks, eager
and compiled, train as one process does (one launch; the models, batches and training of
``python -m bench.architectures``, which checks more of them on request).

- T5 (encoder-decoder): two block lists (each layer of both a bucket of its own), a
  relative position bias computed by the encoder's first block and passed to the second,
  cross-attention, embeddings tied across encoder, decoder and head;
- Mamba: selective state-space blocks (a causal ``Conv1d``, ``SiLU`` gates, a scan), no
  attention.

The others (GPT-2, GPT-NeoX, Gemma 2, Phi-3, Qwen2, Mixtral, OPT, BLOOM, Falcon,
GPTBigCode, BERT, ViT, Whisper, Qwen3, Qwen3-MoE, Gemma 3, Llama 4, DeepSeek-V3, gpt-oss,
OLMo 2, Mamba-2, Qwen3-Next, Jamba, LFM2, ModernBERT) are left to the tool: each adds its
compiles to the suite for structures close to these and to Llama's (their figures:
docs/large-models.md). Llama 4's complex rotary tables have a test of their own
(``tests/test_region_conj.py``).
"""

from __future__ import annotations

import json

import pytest
import torch
from dist_utils import run_ranks

import graphshard
from bench import architectures

WORLD = 2
STEPS = 3
NAMES = ("t5", "mamba")


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    pytest.importorskip("transformers")
    jobs = [(name, mode) for name in NAMES for mode in architectures.MODES]
    return run_ranks(architectures.train_ranks, WORLD, jobs, STEPS)


@pytest.mark.parametrize("mode", architectures.MODES)
@pytest.mark.parametrize("name", NAMES)
def test_trains_like_one_process(ranks, name, mode):
    want = architectures.train_reference(name, WORLD, STEPS)
    for rank, result in enumerate(ranks):
        got = result[(name, mode)]
        assert "error" not in got, f"rank {rank} raised:\n{got.get('error')}"
    mean = [sum(r[(name, mode)]["losses"][s] for r in ranks) / WORLD for s in range(STEPS)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(want["losses"]), rtol=1e-5,
                               atol=1e-6)
    for result, expected in zip(ranks, want["states"], strict=True):
        state = result[(name, mode)]["state"]
        assert state.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=key)
    initial = architectures.full_state(architectures.build(name))
    assert any(not torch.equal(initial[k], v) for k, v in want["states"][0].items())  # trained
    # the tool's own verdict on the same results
    row = architectures.compare([r[(name, mode)] for r in ranks], want, 1e-5, 1e-6)
    assert row["ok"] and row["loss_rel"] < 1e-5 and row["state_abs"] < 1e-5, row
    # compiled, one step graph: T5's blocks hand on the position bias they are given, which
    # broke the graph at every block (tests/test_region_passthrough.py)
    assert row.get("graphs") == (1 if mode == "compiled" else None), row
    assert not row.get("recompiles"), row  # and the later steps run that graph


def test_the_tool_checks_an_architecture_end_to_end(tmp_path, capsys):
    """``python -m bench.architectures`` as documented, on one architecture in eager mode:
    its own launch, the table and the JSON rows; the caller's thread count is given back
    (the reference trains on one thread)."""
    pytest.importorskip("transformers")
    out = tmp_path / "rows.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rows = architectures.main(["--models", "gpt2", "--modes", "eager", "--steps", "2",
                                   "--json", str(out)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert json.loads(out.read_text()) == rows
    (row,) = rows
    assert row["architecture"] == "gpt2" and row["mode"] == "eager" and row["ok"], row
    assert "| gpt2 | Conv1D layers" in capsys.readouterr().out


def test_a_model_whose_library_is_missing_is_refused_by_name(monkeypatch, capsys):
    found = architectures.importlib.util.find_spec
    missing = {"diffusers", "torchvision"}
    monkeypatch.setattr(architectures.importlib.util, "find_spec",
                        lambda name: None if name in missing else found(name))
    with pytest.raises(SystemExit):
        architectures.parse_args(["--models", "gpt2", "unet", "vae", "resnet"])
    err = capsys.readouterr().err
    assert "unet, vae need diffusers: pip install diffusers" in err
    assert "resnet need torchvision" in err and "matches the installed torch" in err
    assert architectures.parse_args(["--models", "gpt2"]).models == ["gpt2"]


def test_the_verdict_names_a_difference_and_a_failure():
    state = {"w": torch.ones(3)}
    reference = {"losses": [2.0, 1.0], "states": [state, state]}
    same = {"losses": [2.0, 1.0], "state": {"w": torch.ones(3)}}
    assert architectures.compare([same, same], reference, 1e-5, 1e-6)["ok"]
    moved = {"losses": [2.0, 1.0], "state": {"w": torch.tensor([1.0, 1.0, 1.01])}}
    for ranks in ([moved, same], [same, moved]):  # either rank's state
        row = architectures.compare(ranks, reference, 1e-5, 1e-6)
        assert not row["ok"] and row["state_abs"] == pytest.approx(0.01, rel=1e-4)
    off = {"losses": [2.0, 1.1], "state": {"w": torch.ones(3)}}
    row = architectures.compare([same, off], reference, 1e-5, 1e-6)  # the mean is 1.05
    assert not row["ok"] and row["loss_rel"] == pytest.approx(0.05)
    extra = {"losses": [2.0, 1.0], "state": {"w": torch.ones(3), "b": torch.ones(1)}}
    row = architectures.compare([same, extra], reference, 1e-5, 1e-6)
    assert not row["ok"] and row["error"] == "rank 1's state keys differ: ['b']"
    failed = {"error": "Traceback ...\n  ...\nRuntimeError: boom\n"}
    row = architectures.compare([same, failed], reference, 1e-5, 1e-6)
    assert row == {"ok": False, "error": "RuntimeError: boom"}
    text = architectures.table([{"architecture": "t5", "mode": "eager", **row},
                                {"architecture": "vit", "mode": "compiled", "ok": False,
                                 "loss_rel": 0.0, "state_abs": 0.5}])
    assert "eager failed: RuntimeError: boom" in text and "**compiled differs**" in text
    broken = {**same, "graphs": 3}  # a compiled run Dynamo split: alike, in pieces
    row = architectures.compare([broken, broken], reference, 1e-5, 1e-6)
    assert row["ok"] and row["graphs"] == 3
    text = architectures.table([{"architecture": "t5", "mode": "compiled", **row}])
    assert "| as one process; compiled in 3 graphs (graph breaks) |" in text
    again = {**same, "graphs": 1, "recompiles": 1}  # a guard failed at a later step
    row = architectures.compare([again, again], reference, 1e-5, 1e-6)
    assert row["ok"] and row["graphs"] == 1 and row["recompiles"] == 1
    text = architectures.table([{"architecture": "vit", "mode": "compiled", **row}])
    assert "| as one process; compiled again for later steps: 1 recompile(s) |" in text
    whole = architectures.compare([{**same, "graphs": 1, "recompiles": 0}] * 2, reference,
                                  1e-5, 1e-6)
    assert "| as one process |" in architectures.table(
        [{"architecture": "t5", "mode": "compiled", **whole}])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_reference_keeps_each_ranks_buffers(monkeypatch, compiled):
    """A batch norm's running statistics in the reference follow each rank's batches alone
    (as each rank's do under graphshard and DDP), while the parameters are shared; under
    plain ``torch.compile`` too (``--compiled-reference compiled``), whose graph updates the
    buffers it is handed. The norm reads the pictures first, so rank r's running mean is the
    running average of its own batches' channel means."""
    def build() -> torch.nn.Module:
        side = architectures.zoo.PICTURE - 2
        return torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.Conv2d(3, 4, 3),
                                   torch.nn.Flatten(), torch.nn.Linear(4 * side * side, 10))

    monkeypatch.setitem(architectures.ARCHITECTURES, "norm_first", architectures.Architecture(
        build, "image", "a batch norm on the pictures"))
    steps = 3
    torch._dynamo.reset()
    reference = architectures.train_reference("norm_first", WORLD, steps, compiled)
    first, second = reference["states"]
    for rank, state in enumerate(reference["states"]):
        norm = torch.nn.BatchNorm2d(3)
        for step in range(steps):
            norm(architectures.batch("norm_first", step, rank)["pixels"])
        torch.testing.assert_close(state["0.running_mean"], norm.running_mean)
        torch.testing.assert_close(state["0.running_var"], norm.running_var)
        assert int(state["0.num_batches_tracked"]) == steps
    assert not torch.equal(first["0.running_mean"], second["0.running_mean"])
    for key in ("0.weight", "1.weight", "3.bias"):
        assert torch.equal(first[key], second[key]), key


def test_every_architecture_the_tool_lists_builds_and_gives_a_loss():
    """Each config of ``bench.architectures`` still builds with the installed libraries, and
    its batch gives a finite loss that reaches every parameter (one process, one forward and
    backward), so that the tool's list does not rot between its runs. torchvision cannot be
    installed beside the CPU build of torch (its wheels are CUDA builds): its models are
    checked where it imports (a side environment with torch 2.14.1 and torchvision 0.29.1),
    and timm's with them."""
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    libraries = {"transformers", "diffusers"}
    for library in ("torchvision", "timm"):  # timm imports torchvision
        if all(architectures.importlib.util.find_spec(n) for n in (library, "torchvision")):
            libraries.add(library)
    names = [name for name, built in architectures.ARCHITECTURES.items()
             if built.library in libraries]
    assert len(names) >= 33
    for name in names:
        model = architectures.build(name)
        loss = architectures.loss(name, model, 0, 0)
        assert torch.isfinite(loss), name
        loss.backward()
        unreached = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert not unreached, (name, unreached)


def test_options_are_read_as_literals_and_bad_ones_refused(capsys):
    """``--shard-option``/``--backend-option`` take ``NAME=VALUE``: a Python literal where it
    reads as one, else the text; ``offload`` takes only ``cpu``; torchvision's models are
    refused with ``--gradient-checkpointing``, which they have no means for."""
    args = architectures.parse_args([
        "--models", "gpt2", "--shard-option", "reshard_after_forward=False",
        "--shard-option", "offload=cpu", "--backend-option", "prefetch_depth=2",
        "--backend-option", "all_gather_via=coalesced", "--gradient-checkpointing"])
    assert args.shard_options == {"reshard_after_forward": False, "offload": "cpu"}
    assert args.backend_options == {"prefetch_depth": 2, "all_gather_via": "coalesced"}
    assert args.gradient_checkpointing
    for bad in (["--shard-option", "reshard_after_forward"], ["--shard-option", "offload=gpu"],
                ["--backend-option", "2=x"]):
        with pytest.raises(SystemExit):
            architectures.parse_args(["--models", "gpt2", *bad])
        assert "NAME=VALUE" in capsys.readouterr().err or "offload=cpu" in bad[1]
    with pytest.raises(SystemExit):
        architectures.parse_args(["--models", "gpt2", "resnet", "--gradient-checkpointing"])
    assert "resnet (torchvision) have no activation checkpointing" in capsys.readouterr().err


def test_gradient_checkpointing_is_the_libraries_own():
    """transformers' and diffusers' models get their own checkpointing turned on (the flag
    their layers read); a model without one is refused by name."""
    pytest.importorskip("transformers")
    pytest.importorskip("diffusers")
    for name in ("gpt2", "unet"):
        model = architectures.build(name)
        assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        architectures.zoo.enable_gradient_checkpointing(model)
        assert any(getattr(m, "gradient_checkpointing", False) is True
                   for m in model.modules()), name
    with pytest.raises(ValueError, match="Linear has no activation checkpointing"):
        architectures.zoo.enable_gradient_checkpointing(torch.nn.Linear(2, 2))


def test_train_ranks_passes_the_options_on(one_rank):
    """``train_ranks`` shards with ``shard_options`` and compiles with ``backend_options``
    (an option each refuses shows that it reached them), and trains with checkpointing on
    as one process does."""
    pytest.importorskip("transformers")
    Setup = architectures.Setup
    jobs = [("gpt2", "eager")]
    got = architectures.train_ranks(0, 1, jobs, 1, Setup({"reshard_after_forward": "sometimes"}))
    assert "reshard_after_forward" in got[("gpt2", "eager")]["error"]
    got = architectures.train_ranks(0, 1, [("gpt2", "compiled")], 1,
                                    Setup(backend={"prefetch_depth": -1}))
    assert "prefetch_depth" in got[("gpt2", "compiled")]["error"]
    got = architectures.train_ranks(0, 1, jobs, 2, Setup(
        {"reshard_after_forward": False, "offload": "host"}, gradient_checkpointing=True))
    row = architectures.compare([got[("gpt2", "eager")]],
                                architectures.train_reference("gpt2", 1, 2), 1e-5, 1e-6)
    assert row["ok"], row


def test_offload_host_offloads_with_the_host_standing_in(one_rank):
    """``offload=host`` shards with ``CPUOffload`` on the CPU mesh, the host standing in for
    the accelerator; ``offload=cpu`` asks for an accelerator mesh, as ``shard`` does."""
    from graphshard.api.sharding import shard_state

    model = architectures._shard(torch.nn.Linear(4, 4), None, {"offload": "host"})
    assert shard_state(model).offload == graphshard.CPUOffload(pin_memory=False)
    with pytest.raises(ValueError, match="this mesh is on 'cpu'"):
        architectures._shard(torch.nn.Linear(4, 4), None, {"offload": "cpu"})


def test_replicas_shard_over_a_2d_mesh():
    """``--replicas 2`` at 2 ranks is HSDP of two replicas of one shard each: the parameters
    are placed on both mesh dimensions, and the training is one process's."""
    pytest.importorskip("transformers")
    ranks = run_ranks(architectures.train_ranks, WORLD, [("gpt2", "eager")], 2,
                      architectures.Setup(replicas=2))
    for result in ranks:
        assert result[("gpt2", "eager")]["placements"] == ("R", "S(0)")
    row = architectures.compare([r[("gpt2", "eager")] for r in ranks],
                                architectures.train_reference("gpt2", WORLD, 2), 1e-5, 1e-6)
    assert row["ok"], row


def test_replicas_must_divide_the_world(capsys):
    with pytest.raises(SystemExit):
        architectures.parse_args(["--models", "gpt2", "--world-size", "3", "--replicas", "2"])
    assert "--replicas 2 must be at least 1 and divide --world-size 3" in capsys.readouterr().err


def test_resume_after_trains_on_from_a_checkpoint(one_rank, tmp_path, capfd):
    """``resume_after``: the training saves a checkpoint after step 1, a model built,
    sharded and compiled anew loads it (model and AdamW) and trains the last steps; the
    whole equals one process's uninterrupted training (a model that did not load would be
    at its initial weights, an optimizer at step 0)."""
    pytest.importorskip("transformers")
    setup = architectures.Setup(resume_after=1, checkpoint_dir=str(tmp_path))
    got = architectures.train_ranks(0, 1, [("gpt2", "compiled")], 3, setup)
    assert "gpt2 compiled: resumed from step_00000001" in capfd.readouterr().err
    assert (tmp_path / "gpt2-compiled" / "step_00000001").is_dir()
    row = architectures.compare([got[("gpt2", "compiled")]],
                                architectures.train_reference("gpt2", 1, 3), 1e-5, 1e-6)
    assert row["ok"], row


def test_resume_after_must_leave_steps_on_both_sides(capsys):
    for k in ("0", "3"):
        with pytest.raises(SystemExit):
            architectures.parse_args(["--models", "gpt2", "--resume-after", k])
        assert "must be between 1 and --steps - 1 (2)" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs a checkpoint_dir"):
        architectures.Setup(resume_after=1)
