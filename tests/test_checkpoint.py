"""Sharded checkpoints on real gloo ranks: resume, reshard on load, interrupted saves,
mismatched checkpoints, full state dicts through torch's ``get_/set_model_state_dict``.

One sequence shares a checkpoint directory (module fixture ``runs``):

1. world 2: train 3 steps, save, train 3 more (``awkward`` eager, tiny Llama compiled);
2. world 3: load the world-2 checkpoints and save them again; mismatched loads; a full
   state dict broadcast from rank 0;
   torch's ``dcp.async_save`` at step 3 too, written while the next 3 steps train;
3. world 1 (in this process): load the world-2 and world-3 checkpoints, save again; load
   the asynchronous one with ``dcp.load``;
4. world 2, fresh processes and process group: resume from step 3 and train 3 steps; load
   the world-3 and world-1 checkpoints back; then save step 6 with rank 1 killed mid-save;
5. world 1 (in this process): the step-3 checkpoint is still the latest and loads exactly.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ckpt_utils import (
    assert_equal_state,
    build,
    full_optim_state,
    launch,
    optimizer,
    results,
    single_rank_group,
    train,
)
from dist_utils import example_runner, full_state
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

import graphshard
from graphshard.state.checkpoint import COMMIT_MARKER

# model -> how the resume test runs it
KINDS = {"awkward": "eager", "llama": "compiled"}


def _sharded(kind: str, mode: str = "eager"):
    torch._dynamo.reset()
    model = graphshard.shard(build(kind))
    run = torch.compile(model, backend="graphshard") if mode == "compiled" else model
    opt, sched = optimizer(model)
    return model, run, opt, sched


def _snapshot(model, opt) -> dict:
    return {"params": full_state(model), "optim": full_optim_state(model, opt)}


def _dcp_state(model, opt) -> dict:
    """What a DCP user saves and loads: torch's state dicts of the model and optimizer."""
    model_state, optim_state = get_state_dict(model, opt)
    return {"model": model_state, "optim": optim_state}


def job_train_and_save(rank: int, world_size: int, root: str) -> dict:
    out = {}
    # dcp.async_save's collectives run in a thread of their own: on a gloo-only world they
    # need a group of their own, or they interleave with the training's on one group
    async_group = dist.new_group(backend="gloo")
    for kind, mode in KINDS.items():
        model, run, opt, sched = _sharded(kind, mode)
        initial = full_state(model)
        train(kind, run, opt, sched, range(0, 3))
        graphshard.save_checkpoint(f"{root}/{kind}", model, opt, step=3,
                                   extra={"scheduler": sched.state_dict()})
        at3 = _snapshot(model, opt)
        pending = dcp.async_save(_dcp_state(model, opt), checkpoint_id=f"{root}/{kind}_async",
                                 process_group=async_group)
        if kind == "awkward":
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                  cpu_offload=True))
            out["rank0_only_keys"] = sorted(full)
            if rank == 0:
                torch.save(full, f"{root}/awkward_full.pt")
        losses = train(kind, run, opt, sched, range(3, 6))  # while the async save writes
        pending.result()
        out[kind] = {"initial": initial, "at3": at3, "losses": losses,
                     "final": _snapshot(model, opt)}
    return out


def _load(kind: str, path: str) -> tuple:
    """A fresh sharded ``kind`` with the checkpoint at ``path`` loaded (its optimizer as
    ``model.opt``), and a snapshot of what was loaded."""
    model, _, opt, _ = _sharded(kind)
    info = graphshard.load_checkpoint(path, model, opt)
    model.opt = opt
    return model, {"step": info.step, "saved_world": info.world_size, "path": info.path.name,
                   **_snapshot(model, opt)}


def _refused(fn) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def job_world3(rank: int, world_size: int, root: str) -> dict:
    out = {}
    for kind in KINDS:
        model, out[kind] = _load(kind, f"{root}/{kind}")
        graphshard.save_checkpoint(f"{root}/{kind}_w3", model, model.opt, step=3)
    # a full state dict read on rank 0 only, broadcast to the others
    model, _, _, _ = _sharded("awkward")
    full = torch.load(f"{root}/awkward_full.pt") if rank == 0 else None
    set_model_state_dict(model, full if rank == 0 else {}, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    out["from_rank0"] = full_state(model)
    # a checkpoint of another model: refused before the model is touched
    model, _, opt, _ = _sharded("awkward")
    before = full_state(model)
    out["wrong_model"] = _refused(lambda: graphshard.load_checkpoint(f"{root}/llama", model, opt))
    opt2 = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "scale"])
    out["wrong_groups"] = _refused(lambda: graphshard.load_checkpoint(f"{root}/awkward", model,
                                                                      opt2))
    out["untouched"] = all(torch.equal(before[k], v)
                           for k, v in full_state(model).items())
    return out


def world1(root: str) -> dict:
    """World 1, run in this process (a process group of one)."""
    out = {}
    for name, kind in [("awkward", "awkward"), ("awkward_w3", "awkward"),
                       ("llama_w3", "llama")]:
        model, out[name] = _load(kind, f"{root}/{name}")
        if name == "awkward_w3":
            graphshard.save_checkpoint(f"{root}/awkward_w1", model, model.opt, step=3)
    model, _, _, _ = _sharded("awkward")
    set_model_state_dict(model, torch.load(f"{root}/awkward_full.pt"),
                         options=StateDictOptions(full_state_dict=True))
    out["full"] = full_state(model)
    for kind in KINDS:  # torch's asynchronous saves, as torch loads them
        model, _, opt, _ = _sharded(kind)
        state = _dcp_state(model, opt)
        dcp.load(state, checkpoint_id=f"{root}/{kind}_async")
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        out[f"{kind}_async"] = _snapshot(model, opt)
    return out


def job_resume_then_die(rank: int, world_size: int, root: str) -> None:
    out = {}
    for kind, mode in KINDS.items():
        model, run, opt, sched = _sharded(kind, mode)
        info = graphshard.load_checkpoint(f"{root}/{kind}", model, opt)
        sched.load_state_dict(info.extra["scheduler"])
        losses = train(kind, run, opt, sched, range(info.step, info.step + 3))
        out[kind] = {"losses": losses, "final": _snapshot(model, opt)}
    out["back"] = {name: _load(kind, f"{root}/{name}")[1]
                   for name, kind in [("awkward_w3", "awkward"), ("awkward_w1", "awkward"),
                                      ("llama_w3", "llama")]}
    torch.save(out, f"{root}/resume_rank{rank}.pt")  # rank 1 will not return
    # save step 6 while rank 1 dies after writing its data, before the save completes
    model, run, opt, sched = _sharded("awkward")
    graphshard.load_checkpoint(f"{root}/awkward", model, opt)
    train("awkward", run, opt, sched, range(3, 6))
    if rank == 1:
        from torch.distributed.checkpoint import FileSystemWriter

        write = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write(self, plan, planner).wait()
            os._exit(9)

        FileSystemWriter.write_data = write_then_die
    with graphshard.report_rank_failures():
        graphshard.save_checkpoint(f"{root}/awkward", model, opt, step=6)


def after_kill(root: str) -> dict:
    """World 1, in this process: what the interrupted save left behind."""
    ckpt = Path(root) / "awkward"
    out = {"latest": graphshard.latest_checkpoint(ckpt), "tmp_dir": None}
    out["loaded"] = _load("awkward", str(ckpt))[1]
    model, _, _, _ = _sharded("awkward")
    out["tmp_dir"] = _refused(lambda: graphshard.load_checkpoint(ckpt / ".tmp-step_00000006",
                                                                 model))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("ckpt"))
    out = {"root": Path(root)}
    out["w2"] = results(launch(job_train_and_save, 2, root))
    out["w3"] = results(launch(job_world3, 3, root))
    with single_rank_group(root):
        out["w1"] = world1(root)
    out["kill"] = launch(job_resume_then_die, 2, root, pg_timeout_s=20, grace_s=30)
    out["resume"] = [torch.load(f"{root}/resume_rank{r}.pt") for r in range(2)]
    with single_rank_group(root):
        out["after_kill"] = after_kill(root)
    return out


def test_resume_is_bit_identical(runs):
    for kind in KINDS:
        for rank, (first, again) in enumerate(zip(runs["w2"], runs["resume"], strict=True)):
            assert again[kind]["losses"] == first[kind]["losses"], (kind, rank)
            assert_equal_state(again[kind]["final"], first[kind]["final"], f"{kind} rank {rank}")
        # the training did move the parameters, so equality above is not vacuous
        w2 = runs["w2"][0][kind]
        assert not torch.equal(w2["initial"]["scale" if kind == "awkward" else "norm.weight"],
                               w2["at3"]["params"]["scale" if kind == "awkward"
                                                   else "norm.weight"])


def test_reshard_on_load_world3_and_world1(runs):
    for kind in KINDS:
        saved = runs["w2"][0][kind]["at3"]
        for rank, got in enumerate(runs["w3"]):
            assert (got[kind]["step"], got[kind]["saved_world"]) == (3, 2)
            assert_equal_state(got[kind]["params"], saved["params"], f"w3 rank {rank} {kind}")
            assert_equal_state(got[kind]["optim"], saved["optim"], f"w3 rank {rank} {kind}")
    w1 = runs["w1"]
    for name, kind, world in [("awkward", "awkward", 2), ("awkward_w3", "awkward", 3),
                              ("llama_w3", "llama", 3)]:
        saved = runs["w2"][0][kind]["at3"]
        assert w1[name]["saved_world"] == world
        assert_equal_state(w1[name]["params"], saved["params"], f"w1 {name}")
        assert_equal_state(w1[name]["optim"], saved["optim"], f"w1 {name}")


def test_dcp_async_save_holds_the_step_it_was_given_while_training_goes_on(runs):
    """``dcp.async_save`` copies the shards (views into graphshard's bucket buffers) before it
    returns: the checkpoint written while steps 4 to 6 trained in place holds step 3."""
    for kind in KINDS:
        w2 = runs["w2"][0][kind]
        got = runs["w1"][f"{kind}_async"]
        assert_equal_state(got["params"], w2["at3"]["params"], f"async {kind}")
        assert_equal_state(got["optim"], w2["at3"]["optim"], f"async {kind}")
        moved = [k for k, v in w2["final"]["params"].items()
                 if not torch.equal(v, w2["at3"]["params"][k])]
        assert moved, kind  # the training did change the shards during the write


def test_reshard_back_to_world2(runs):
    for rank, out in enumerate(runs["resume"]):
        for name, kind, world in [("awkward_w3", "awkward", 3), ("awkward_w1", "awkward", 1),
                                  ("llama_w3", "llama", 3)]:
            saved = runs["w2"][0][kind]["at3"]
            assert out["back"][name]["saved_world"] == world
            assert_equal_state(out["back"][name]["params"], saved["params"], f"{rank} {name}")
            assert_equal_state(out["back"][name]["optim"], saved["optim"], f"{rank} {name}")


def test_interrupted_save_keeps_the_previous_checkpoint(runs):
    rank0, rank1 = runs["kill"]
    assert rank1.exitcode == 9 and rank1.error is None  # killed inside the save
    # rank 0's save failed at once (no hang), with an error that says what happened
    assert rank0.exitcode == 1 and rank0.error_type == "RankFailureError"
    assert "no rank reported an error, so a rank died" in rank0.error
    assert rank0.seconds < 60
    ckpt = runs["root"] / "awkward"
    assert (ckpt / ".tmp-step_00000006").is_dir()
    assert not (ckpt / "step_00000006").exists()
    after = runs["after_kill"]
    assert after["latest"] == ckpt / "step_00000003"
    assert (ckpt / "step_00000003" / COMMIT_MARKER).is_file()
    assert after["loaded"]["step"] == 3
    saved = runs["w2"][0]["awkward"]["at3"]
    assert_equal_state(after["loaded"]["params"], saved["params"], "after the kill")
    assert_equal_state(after["loaded"]["optim"], saved["optim"], "after the kill")
    assert "no COMMITTED marker" in after["tmp_dir"]


def test_mismatched_checkpoint_is_refused_before_loading(runs):
    for out in runs["w3"]:  # every rank refuses on its own: none waits in a collective
        msg = out["wrong_model"]
        assert msg.startswith("CheckpointMismatchError")
        assert "missing from the checkpoint (8): scale, shift, mix, offset, proj.weight" in msg
        assert "not in the model" in msg and "layers.0.attention.wq.weight" in msg
        assert "param_groups[0]" in out["wrong_groups"] and "'scale'" in out["wrong_groups"]
        assert out["untouched"]


def test_full_state_dict_export_and_load(runs):
    w2 = runs["w2"]
    assert w2[0]["rank0_only_keys"] == sorted(w2[0]["awkward"]["at3"]["params"])
    assert w2[1]["rank0_only_keys"] == []
    saved = torch.load(runs["root"] / "awkward_full.pt")
    assert all(v.device.type == "cpu" for v in saved.values())
    assert_equal_state(saved, w2[0]["awkward"]["at3"]["params"], "torch.save file")
    for out in runs["w3"]:
        assert_equal_state(out["from_rank0"], saved, "from_rank0 at world 3")
    assert_equal_state(runs["w1"]["full"], saved, "set_model_state_dict at world 1")
    # a plain, unsharded model loads the export
    plain = build("awkward")
    plain.load_state_dict(saved)
    assert torch.equal(plain.scale.detach(), saved["scale"])


def test_example_checkpoint_dir_and_resume(tmp_path, monkeypatch):
    main = example_runner(monkeypatch, "--model", "tiny", "--eager", "--seq-len", "16",
                          "--batch-size", "2", "--timeout-s", "30")
    straight = main("--steps", "4")
    ckpt = str(tmp_path / "ckpt")
    main("--steps", "2", "--checkpoint-dir", ckpt)
    assert graphshard.latest_checkpoint(ckpt).name == "step_00000002"
    resumed = main("--steps", "4", "--checkpoint-dir", ckpt, "--resume", "--keep-last", "1")
    assert resumed == straight  # same last loss, bit for bit
    assert sorted(p.name for p in Path(ckpt).iterdir()) == ["step_00000004"]


def test_torch_state_dicts_on_a_2d_mesh_are_replicate_then_shard():
    from graph_utils import fake_process_group
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from graphshard.models.mlp import OddMLP

    with fake_process_group(4, rank=3):  # replica 1, shard 1 of a (2, 2) HSDP mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = graphshard.shard(OddMLP(), mesh)
        sd = model.state_dict()
        weight = sd["layers.0.weight"]
        assert weight.placements == (Replicate(), Shard(0))
        assert weight.shape == (29, 13) and weight.to_local().shape == (14, 13)  # 15 + 14
        assert sd["layers.4.weight"].to_local().shape == (1, 7)  # 2 + 1 rows of 3
        opt = torch.optim.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        osd = get_optimizer_state_dict(model, opt)
        state = osd["state"]["layers.0.weight"]
        assert state["exp_avg"].placements == (Replicate(), Shard(0))
        assert state["exp_avg"].shape == (29, 13) and state["step"].shape == ()
        assert osd["param_groups"][0]["params"][:2] == ["layers.0.weight", "layers.0.bias"]


def test_save_inside_a_no_sync_window_is_refused(tmp_path):
    from graph_utils import fake_process_group

    from graphshard.models.mlp import OddMLP

    with fake_process_group(2):
        model = graphshard.shard(OddMLP())
        with graphshard.no_sync(model):
            model(torch.randn(4, 13), torch.randn(4, 3)).loss.backward()
        with pytest.raises(RuntimeError, match="held back by graphshard.no_sync"):
            graphshard.save_checkpoint(tmp_path, model, step=1)
        assert not any(tmp_path.iterdir())  # nothing written
