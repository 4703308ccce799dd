"""Hugging Face weights into a sharded model, against ``from_pretrained`` in one process,
and back out.

A small random Llama (``tie_word_embeddings`` True and False) is written with
``save_pretrained`` to a temporary directory (no hub). On 2 gloo ranks (one ``run_ranks``
launch for every case, jobs in ``hf_jobs``) each job builds it with
``AutoModelForCausalLM.from_config`` on the meta device (``hf_jobs.BUILD_DEVICE``), shards
it, calls ``to_empty``, recomputes the rotary buffers (``init_non_persistent_buffers``) and
loads the directory either way (rank 0 reads and broadcasts; every rank reads its rows),
then trains 3 SGD (momentum) steps, eagerly and compiled. It must hold exactly what
``from_pretrained`` loads and train like it: the same losses per step and final parameters.
Loading the directory of another config raises, naming the keys, and writes nothing.
Written back out in the Hugging Face format after training (``save_pretrained`` of the full
state dict, or DCP's ``HuggingFaceStorageWriter``), ``from_pretrained`` reads exactly the
trained parameters.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist_utils import run_ranks
from hf_jobs import (
    BUILD_DEVICE,
    MODES,
    STEPS,
    WAYS,
    buffers,
    params,
    reference,
    run_jobs,
    save_random,
)

import graphshard
from graphshard import CheckpointMismatchError

WORLD = 2
TIES = (True, False)
TRAIN = [(t, w, m) for t in TIES for w in WAYS for m in MODES]
TRAIN_IDS = [f"{'tied' if t else 'untied'}-{w}-{m}" for t, w, m in TRAIN]
BAD = [(t, w) for t in TIES for w in WAYS]
BAD_IDS = [f"{'tied' if t else 'untied'}-{w}" for t, w in BAD]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict:
    out = {}
    for name, tie, other in (("tied", True, False), ("untied", False, False),
                             ("other", True, True)):
        out[name] = str(tmp_path_factory.mktemp(f"hf_{name}"))
        save_random(out[name], tie, other)
    return out


def _dir(dirs: dict, tie: bool) -> str:
    return dirs["tied" if tie else "untied"]


def _train_job(dirs: dict, tie: bool, way: str, mode: str) -> tuple:
    """Eager: a fresh model per way. Compiled: one model (one compile) loads and trains
    both ways in turn."""
    ways = WAYS if mode == "compiled" else (way,)
    return ("train", mode, _dir(dirs, tie), ways)


EXPORT_WAYS = ("save_pretrained", "dcp")


@pytest.fixture(scope="module")
def export_dirs(tmp_path_factory) -> dict:
    """Per tie, per way of writing: an empty directory for the trained model."""
    return {tie: {way: str(tmp_path_factory.mktemp(f"export_{tie}_{way}"))
                  for way in EXPORT_WAYS} for tie in TIES}


def _export_job(dirs: dict, export_dirs: dict, tie: bool) -> tuple:
    return ("export", "compiled", _dir(dirs, tie), tuple(export_dirs[tie].items()))


def _unreadable(dirs: dict, way: str) -> tuple[str, str]:
    """Per rank, the directory it loads: rank 0 (the reader, with ``rank0``) gets none."""
    missing = dirs["tied"] + "-missing"
    return (missing, dirs["tied"]) if way == "rank0" else (dirs["tied"], missing)


@pytest.fixture(scope="module")
def ranks(dirs, export_dirs) -> list[dict]:
    jobs = list(dict.fromkeys(_train_job(dirs, t, w, m) for t, w, m in TRAIN))
    jobs += [_export_job(dirs, export_dirs, t) for t in TIES]
    jobs += [("bad", "eager", _dir(dirs, t), dirs["other"], w) for t, w in BAD]
    jobs += [("unreadable", "eager", _unreadable(dirs, w), w) for w in WAYS]
    return run_ranks(run_jobs, WORLD, jobs)


def _train(ranks, dirs, tie: bool, way: str, mode: str) -> list[dict]:
    out = []
    for rank, res in enumerate(ranks):
        got = res[_train_job(dirs, tie, way, mode)]
        if "failed" in got:
            pytest.fail(f"rank {rank} raised:\n{got['failed']}")
        out.append({**got[way], "graphs": got["graphs"]})
    return out


@functools.lru_cache
def _reference(path: str) -> dict:
    return reference(path, WORLD)


def _assert_equal(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("tie,way,mode", TRAIN, ids=TRAIN_IDS)
def test_loads_exactly_what_from_pretrained_loads(ranks, dirs, tie, way, mode):
    ref = _reference(_dir(dirs, tie))
    for res in _train(ranks, dirs, tie, way, mode):
        assert res["devices_before_to_empty"] == [BUILD_DEVICE.type]
        _assert_equal(res["loaded"], ref["loaded"])
        assert res["tied"] == ref["tied"] == tie  # one Parameter under both names
        # The rotary buffers are in no file: recomputed, bit-equal to from_pretrained's.
        assert res["recomputed"] == ["model.rotary_emb.inv_freq",
                                     "model.rotary_emb.original_inv_freq"]
        _assert_equal(res["buffers"], ref["buffers"])
        # The tied head is read from the embedding's one stored copy.
        assert ("lm_head.weight" in res["loaded_keys"]) is not tie


@pytest.mark.parametrize("tie,way,mode", TRAIN, ids=TRAIN_IDS)
def test_trains_like_from_pretrained(ranks, dirs, tie, way, mode):
    ref = _reference(_dir(dirs, tie))
    results = _train(ranks, dirs, tie, way, mode)
    losses = torch.tensor([r["losses"] for r in results], dtype=torch.float64).mean(0)
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, torch.tensor(ref["losses"], dtype=torch.float64),
                               rtol=1e-5, atol=0)  # fmt: skip
    for res in results:
        assert list(res["final"]) == list(ref["final"])
        for name, value in ref["final"].items():
            torch.testing.assert_close(res["final"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"{n}: {m}")  # fmt: skip
    assert all(not torch.equal(ref["final"][k], v) for k, v in ref["loaded"].items())


@pytest.mark.parametrize("tie,way,mode", TRAIN, ids=TRAIN_IDS)
def test_each_rank_holds_its_rows(ranks, dirs, tie, way, mode):
    ref = _reference(_dir(dirs, tie))
    results = _train(ranks, dirs, tie, way, mode)
    for name, value in ref["loaded"].items():
        if name in results[0]["local_rows"]:  # a tied name is listed once
            rows = [r["local_rows"][name] for r in results]
            assert rows == [len(c) for c in torch.chunk(value, WORLD)], name
    for res in results:
        if mode == "compiled":
            assert res["graphs"] >= 1
        else:
            assert res["graphs"] == 0


@pytest.mark.parametrize("tie,way", BAD, ids=BAD_IDS)
def test_other_models_weights_raise_naming_keys_and_write_nothing(ranks, dirs, tie, way):
    for rank, res in enumerate(ranks):
        got = res[("bad", "eager", _dir(dirs, tie), dirs["other"], way)]
        if "failed" in got:
            pytest.fail(f"rank {rank} raised:\n{got['failed']}")
        assert got["error"] is not None, "loading another model's weights did not raise"
        kind, message = got["error"]
        assert kind == "CheckpointMismatchError"
        for layer in (0, 1):
            mlp = f"model.layers.{layer}.mlp"
            assert f"{mlp}.down_proj.weight: safetensors checkpoint (64, 96) vs model " \
                "(64, 128)" in message
            assert f"{mlp}.up_proj.weight: safetensors checkpoint (96, 64) vs model " \
                "(128, 64)" in message
        assert "shape differs (6)" in message
        assert "model.embed_tokens.weight" not in message  # fits; not written either
        assert "not in the model (9): model.layers.2." in message  # the third layer's
        assert ("lm_head.weight" in message) is not tie  # stored once in the tied file
        _assert_equal(got["after"], got["before"])


@pytest.mark.parametrize("way", WAYS)
def test_a_rank_that_cannot_read_makes_every_rank_raise(ranks, dirs, way):
    paths = _unreadable(dirs, way)
    bad_rank = paths.index(dirs["tied"] + "-missing")
    for rank, res in enumerate(ranks):
        got = res[("unreadable", "eager", paths, way)]
        if "failed" in got:
            pytest.fail(f"rank {rank} raised:\n{got['failed']}")
        kind, message = got["error"]
        assert kind == "GraphshardFileNotFoundError"  # a FileNotFoundError too
        assert "-missing is not a directory" in message
        assert ("(raised on rank" in message) is (rank != bad_rank)


@pytest.mark.parametrize("way", EXPORT_WAYS)
@pytest.mark.parametrize("tie", TIES, ids=["tied", "untied"])
def test_trained_model_written_for_from_pretrained(ranks, dirs, export_dirs, tie, way):
    """The Hugging Face checkpoint of the trained sharded model holds its trained values,
    every one, and ``from_pretrained`` ties the head again."""
    from transformers import AutoModelForCausalLM

    results = []
    for rank, res in enumerate(ranks):
        got = res[_export_job(dirs, export_dirs, tie)]
        if "failed" in got:
            pytest.fail(f"rank {rank} raised:\n{got['failed']}")
        results.append(got)
    back = AutoModelForCausalLM.from_pretrained(export_dirs[tie][way])
    _assert_equal(params(back), results[0]["final"])
    assert (back.lm_head.weight is back.model.embed_tokens.weight) is tie
    loaded = _reference(_dir(dirs, tie))["loaded"]
    assert all(not torch.equal(loaded[k], v) for k, v in results[0]["final"].items())


# --------------------------------------------------------------------------- one process


def _meta_plain(path: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model.to_empty(device="cpu")
    return model


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("tie", TIES, ids=["tied", "untied"])
def test_unsharded_model_loads_without_process_group(dirs, tie):
    """Every rank reading its rows is DCP's load, which also runs in one process."""
    path = _dir(dirs, tie)
    model = _meta_plain(path)
    graphshard.init_non_persistent_buffers(model)
    if tie:  # unsharded, to_empty unties the head from the embedding; the error says so
        with pytest.raises(CheckpointMismatchError, match=r"(?s)missing .*lm_head\.weight.*"
                           r"call model\.tie_weights\(\) after to_empty"):
            graphshard.load_safetensors(model, path)
        model.tie_weights()
    graphshard.load_safetensors(model, path)
    ref = _reference(path)
    _assert_equal({**params(model), **buffers(model)}, {**ref["loaded"], **ref["buffers"]})


def test_missing_directory_or_files_raise(tmp_path, dirs):
    model = _meta_plain(dirs["tied"])
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        graphshard.load_safetensors(model, tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match=r"No \*\.safetensors file in"):
        graphshard.load_safetensors(model, tmp_path)


def test_init_non_persistent_buffers_needs_a_pretrained_model():
    with pytest.raises(TypeError, match="not a transformers PreTrainedModel"):
        graphshard.init_non_persistent_buffers(torch.nn.Linear(2, 2))
