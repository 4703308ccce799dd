"""Checkpoints when ranks disagree, files rot, or callers misuse the API.

One launch of 2 gloo ranks (module fixture ``w2``) runs every multi-rank scenario in turn
and returns what each rank saw; world-1 scenarios run in this process (fixture ``w1``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ckpt_utils import build, launch, optimizer, results, single_rank_group, train
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import graphshard
from graphshard.state.checkpoint import COMMIT_MARKER


@dataclass
class NotAllowed:  # torch.load(weights_only=True) refuses it
    value: int = 1


class RunsCode:
    """Unpickling it creates ``flag`` (what a crafted ``extra`` could do)."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        return (open, (self.flag, "w"))


def _error(fn) -> str:
    try:
        fn()
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _timed_error(fn) -> tuple[str, float]:
    start = time.monotonic()
    msg = _error(fn)
    return msg, time.monotonic() - start


def _bn_model() -> nn.Module:
    torch.manual_seed(5)
    return graphshard.shard(nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)))


def _awkward():
    model = graphshard.shard(build("awkward"))
    opt, sched = optimizer(model)
    return model, opt, sched


def _flip_bit_in(path: Path, payload: bytes) -> None:
    """Flip one bit in the middle of ``payload``'s bytes inside the file ``path``."""
    data = bytearray(path.read_bytes())
    at = data.find(payload)
    assert at >= 0, f"tensor bytes not found in {path}"
    data[at + len(payload) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def job_w2(rank: int, world_size: int, root: str) -> dict:
    out: dict = {}
    model, opt, sched = _awkward()
    train("awkward", model, opt, sched, range(2))
    # 4. invalid steps: refused, nothing written
    out["bad_steps"] = [_error(lambda s=s: graphshard.save_checkpoint(f"{root}/bad", model, opt,
                                                                      step=s))
                        for s in (-1, True, "3", 1.5)]
    # 1. ranks disagree on directory or step
    out["diff_dir"] = _error(lambda: graphshard.save_checkpoint(f"{root}/dir{rank}", model, opt,
                                                                step=1))
    out["diff_step"] = _error(lambda: graphshard.save_checkpoint(f"{root}/same", model, opt,
                                                                 step=1 + rank))
    # 13. rank 1 skipped an optimizer step: the ranks' shards hold different steps
    opt.zero_grad(set_to_none=True)
    if rank == 0:
        opt.step()  # no gradients: nothing changes but the count of steps
    out["skipped_step"] = _error(lambda: graphshard.save_checkpoint(f"{root}/skipped", model,
                                                                    opt, step=1))
    if rank == 1:
        opt.step()  # the ranks agree again
    dist.barrier()
    out["disagree_left"] = sorted(os.listdir(root))
    # 9. rank 0 cannot create the directory; rank 1 has an optimizer of foreign parameters
    if rank == 0:
        Path(f"{root}/afile").write_text("not a directory")
    dist.barrier()
    out["unwritable"] = _timed_error(lambda: graphshard.save_checkpoint(
        f"{root}/afile/ckpt", model, opt, step=1))
    foreign = torch.optim.AdamW([nn.Parameter(torch.ones(2))]) if rank == 1 else opt
    out["rank1_fails"] = _timed_error(lambda: graphshard.save_checkpoint(
        f"{root}/rank1_fails", model, foreign, step=1))
    # 7. an extra that torch.load(weights_only=True) would refuse: refused at save
    out["bad_extra"] = _error(lambda: graphshard.save_checkpoint(
        f"{root}/bad_extra", model, opt, step=1, extra={"x": NotAllowed()}))
    out["bad_extra_left"] = os.path.exists(f"{root}/bad_extra")
    # 5. per-rank buffers: each rank's running stats come back to it
    bn = _bn_model()
    bn(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank)) * (rank + 1) + rank)
    out["bn_saved"] = {k: v.clone() for k, v in bn.state_dict().items()
                       if not hasattr(v, "full_tensor")}
    graphshard.save_checkpoint(f"{root}/bn", bn, step=1)
    fresh = _bn_model()
    graphshard.load_checkpoint(f"{root}/bn", fresh)
    out["bn_loaded"] = {k: v.clone() for k, v in fresh.state_dict().items()
                        if not hasattr(v, "full_tensor")}
    # 6. a bit flipped in the tensor bytes of rank 0's shard file
    path = graphshard.save_checkpoint(f"{root}/flip", model, opt, step=2)
    if rank == 0:
        local = model.proj.weight.to_local().detach().contiguous()
        _flip_bit_in(path / "__0_0.distcp", local.numpy().tobytes())
    dist.barrier()
    fresh, fresh_opt, _ = _awkward()
    before = fresh.proj.weight.to_local().clone()
    out["flipped"] = _error(lambda: graphshard.load_checkpoint(f"{root}/flip", fresh, fresh_opt))
    out["flipped_untouched"] = torch.equal(before, fresh.proj.weight.to_local())
    # 2. stale views: rank 1 sees no step 5 / sees an extra step 6 (cwd-relative copies)
    for step in (4, 5):
        graphshard.save_checkpoint(f"{root}/stale", model, opt, step=step)
    if rank == 0:
        for view, names in [("hidden", ["step_00000004"]),
                            ("extra", ["step_00000004", "step_00000005"]),
                            ("rank0", ["step_00000004", "step_00000005"])]:
            for name in names:
                shutil.copytree(f"{root}/stale/{name}", f"{root}/{view}/ckpt/{name}")
        shutil.copytree(f"{root}/stale/step_00000005", f"{root}/extra/ckpt/step_00000006")
        marker = Path(f"{root}/extra/ckpt/step_00000006/{COMMIT_MARKER}")
        marker.write_text(json.dumps({**json.loads(marker.read_text()), "seq": 99}))
    dist.barrier()
    here = os.getcwd()
    try:
        for case in ("hidden", "extra"):
            os.chdir(f"{root}/{'rank0' if rank == 0 else case}")
            m, o, _ = _awkward()
            out[f"stale_{case}"] = _error(lambda m=m, o=o, case=case: out.setdefault(
                f"stale_{case}_loaded", graphshard.load_checkpoint("ckpt", m, o).path.name))
    finally:
        os.chdir(here)
    # 9. rank 0 calls save alone: it fails fast, saying it is a collective (last: the
    # process group is not usable afterwards)
    if rank == 0:
        out["alone"] = _timed_error(lambda: graphshard.save_checkpoint(
            f"{root}/alone", model, opt, step=7, arrival_timeout_s=3))
    else:
        time.sleep(8)
    return out


@pytest.fixture(scope="module")
def w2_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="module")
def w2(w2_root) -> list[dict]:
    return results(launch(job_w2, 2, str(w2_root), pg_timeout_s=45, deadline_s=240,
                          grace_s=60))


def test_step_must_be_a_non_negative_int(w2):
    for out in w2:
        assert all(msg.startswith("GraphshardValueError: step must be an int >= 0")
                   for msg in out["bad_steps"]), out["bad_steps"]
        assert "bad" not in out["disagree_left"]


def test_ranks_must_agree_on_directory_and_step(w2):
    root = None
    for out in w2:
        msg = out["diff_dir"]
        assert msg.startswith("GraphshardValueError: save_checkpoint needs the same directory")
        assert "dir0', step 1; rank 1: directory" in msg and "dir1'" in msg
        msg = out["diff_step"]
        assert "rank 0: directory" in msg and "step 1; rank 1" in msg and "step 2" in msg
        root = out["disagree_left"]
    assert not {"dir0", "dir1", "same", "skipped"} & set(root)  # nothing written


def test_a_rank_that_skipped_an_optimizer_step_is_refused_at_save(w2):
    for out in w2:
        msg = out["skipped_step"]
        assert msg.startswith("GraphshardRuntimeError: save_checkpoint: the ranks' shards hold "
                              "different training steps"), msg
        assert "rank 0: 3, rank 1: 2" in msg and "optimizer.step() on every step" in msg


def test_an_error_on_one_rank_reaches_every_rank_at_once(w2):
    msg0, secs0 = w2[0]["unwritable"]
    msg1, secs1 = w2[1]["unwritable"]
    assert "afile" in msg0 and msg0.startswith(("NotADirectoryError", "FileExistsError"))
    assert msg1.startswith("GraphshardRuntimeError: Creating") and "rank 0" in msg1
    assert secs1 < 20  # not the 45 s process-group timeout
    msg0, secs0 = w2[0]["rank1_fails"]
    msg1, _ = w2[1]["rank1_fails"]
    assert "not a parameter of this sharded model" in msg1
    assert "failed on rank 1" in msg0 and "not a parameter" in msg0 and secs0 < 20


def test_save_on_one_rank_alone_fails_fast_saying_it_is_collective(w2):
    msg, secs = w2[0]["alone"]
    assert "save_checkpoint is a collective: every rank of the process group must call it" in msg
    assert secs < 20


def test_extra_must_load_with_weights_only(w2):
    for out in w2:
        msg = out["bad_extra"]
        assert "extra must hold only what torch.load(weights_only=True) accepts" in msg
        assert "NotAllowed" in msg or "failed on rank 0" in msg
        assert not out["bad_extra_left"]


def test_each_rank_gets_its_own_buffers_back(w2):
    assert not torch.equal(w2[0]["bn_saved"]["1.running_mean"],
                           w2[1]["bn_saved"]["1.running_mean"])
    for out in w2:
        for key, value in out["bn_saved"].items():
            assert torch.equal(out["bn_loaded"][key], value), key


def test_a_flipped_bit_is_caught_before_loading(w2):
    for out in w2:
        assert "__0_0.distcp is corrupt" in out["flipped"], out["flipped"]
        assert out["flipped_untouched"]


def test_ranks_load_the_checkpoint_rank0_chose(w2):
    for out in w2:
        msg = out["stale_hidden"]
        assert "Ranks see different checkpoints" in msg and "rank 0 chose step_00000005" in msg
        assert "rank 1 sees step_00000004" in msg
        assert out["stale_extra"] == "no error"
        assert out["stale_extra_loaded"] == "step_00000005"


# --------------------------------------------------------------------------- world 1


def _save_steps(root: Path, model, opt, steps, **kw) -> None:
    for step in steps:
        with torch.no_grad():
            model.scale.add_(1.0)
        graphshard.save_checkpoint(root, model, opt, step=step, **kw)


def _scale(model) -> float:
    return float(model.scale.detach().full_tensor())


@pytest.fixture(scope="module")
def w1(tmp_path_factory, w2, w2_root) -> dict:
    root = tmp_path_factory.mktemp("reliability_w1")
    out: dict = {"root": root}
    with single_rank_group(str(root)):
        model, opt, sched = _awkward()
        train("awkward", model, opt, sched, range(1))
        # 3. roll back, then save with keep_last
        ckpt = root / "rollback"
        _save_steps(ckpt, model, opt, range(1, 6), keep_last=3)
        out["kept"] = sorted(p.name for p in ckpt.iterdir())
        m, o, _ = _awkward()
        out["rolled_back_to"] = graphshard.load_checkpoint(ckpt / "step_00000003", m, o).step
        with torch.no_grad():
            m.scale.fill_(42.0)
        graphshard.save_checkpoint(ckpt, m, o, step=4)
        out["latest_after_resave"] = graphshard.latest_checkpoint(ckpt).name
        with torch.no_grad():
            m.scale.fill_(43.0)
        graphshard.save_checkpoint(ckpt, m, o, step=4, keep_last=1)
        out["after_keep_last_1"] = sorted(p.name for p in ckpt.iterdir())
        m2, o2, _ = _awkward()
        out["loaded_scale"] = _scale(m2) if graphshard.load_checkpoint(ckpt, m2, o2) else None
        # 8. AdamW state into SGD
        sgd = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        before = _scale(m2)
        out["into_sgd"] = _error(lambda: graphshard.load_checkpoint(ckpt, m2, sgd))
        out["sgd_untouched"] = _scale(m2) == before and not sgd.state
        # 5. at another world size (world 1): rank 0's buffers
        bn = _bn_model()
        graphshard.load_checkpoint(w2_root / "bn", bn)
        out["bn_w1"] = {k: v.clone() for k, v in bn.state_dict().items()
                        if not hasattr(v, "full_tensor")}
        # 7. a crafted graphshard.pt (its checksum updated too) does not run code
        path = graphshard.save_checkpoint(root / "crafted", model, opt, step=1,
                                          extra={"sched": sched.state_dict()})
        out["scheduler_extra"] = graphshard.load_checkpoint(path, *(_awkward()[:2])).extra
        flag = root / "pwned"
        meta = torch.load(path / "graphshard.pt", weights_only=True)
        torch.save({**meta, "extra": RunsCode(str(flag))}, path / "graphshard.pt")
        marker = json.loads((path / COMMIT_MARKER).read_text())
        data = (path / "graphshard.pt").read_bytes()
        if "files" in marker:
            marker["files"]["graphshard.pt"] = [zlib.crc32(data), len(data)]
            (path / COMMIT_MARKER).write_text(json.dumps(marker))
        out["crafted"] = _error(lambda: graphshard.load_checkpoint(path, *(_awkward()[:2])))
        out["crafted_ran"] = flag.exists()
        # 6. torch's own dcp.load reads a graphshard checkpoint
        import torch.distributed.checkpoint as dcp

        path = graphshard.save_checkpoint(root / "plain", model, opt, step=1)
        sd = {"model/" + k: v for k, v in _awkward()[0].state_dict().items()}
        dcp.load(sd, checkpoint_id=str(path))
        out["dcp_scale"] = float(sd["model/scale"].full_tensor())
        out["model_scale"] = _scale(model)
    return out


def test_rollback_then_keep_last_keeps_what_it_just_wrote(w1):
    assert w1["kept"] == ["step_00000003", "step_00000004", "step_00000005"]
    assert w1["rolled_back_to"] == 3
    assert w1["latest_after_resave"] == "step_00000004"  # committed last, not highest step
    assert w1["after_keep_last_1"] == ["step_00000004"]
    assert w1["loaded_scale"] == 43.0


def test_another_optimizer_type_is_refused_before_loading(w1):
    msg = w1["into_sgd"]
    assert msg.startswith("CheckpointMismatchError") and "AdamW" in msg and "SGD" in msg
    assert w1["sgd_untouched"]


def test_buffers_at_another_world_size_are_rank0s(w1, w2):
    for key, value in w2[0]["bn_saved"].items():
        assert torch.equal(w1["bn_w1"][key], value), key


def test_crafted_metadata_does_not_run_code(w1):
    assert w1["scheduler_extra"]["sched"]["last_epoch"] == 1
    assert not w1["crafted_ran"]
    assert "Weights only load failed" in w1["crafted"] or "weights_only" in w1["crafted"]


def test_torch_dcp_load_reads_a_graphshard_checkpoint(w1):
    assert w1["dcp_scale"] == w1["model_scale"]
