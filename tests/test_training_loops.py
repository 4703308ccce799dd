"""Training loops as users write them, eager and compiled on 2 gloo ranks, against one
process (``training_loops_jobs``): two sharded models in one step (a GAN, a frozen teacher
with its student), a Hugging Face Llama whose decoder layers are compiled one by one, and
mixtures of experts whose ranks route their tokens to different experts."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from training_loops_jobs import (
    EXPERT_STEPS,
    LLAMA_STEPS,
    MODES,
    MUON_STEPS,
    RNN_MODES,
    RNN_STEPS,
    ROLLOUT_OPTIMIZERS,
    STEPS,
    build,
    muon_model,
    reference_block_compile,
    reference_experts,
    reference_muon,
    reference_recurrent,
    reference_rollout,
    reference_two_models,
    run_jobs,
)

import graphshard
from graphshard._torch_version import installed_torch_version

WORLD = 2
BLOCK_COMPILES = ("module_compile", "wrapped")
JOBS = ([("two_models", mode) for mode in MODES]
        + [("block_compile", how) for how in BLOCK_COMPILES]
        + [("experts", mode) for mode in MODES] + [("muon", "eager")]
        + [("recurrent", mode) for mode in RNN_MODES]
        + [("rollout", optimizer) for optimizer in ROLLOUT_OPTIMIZERS])


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    pytest.importorskip("transformers")
    return run_ranks(run_jobs, WORLD, JOBS)


def _result(ranks: list[dict], job: tuple[str, str]) -> list[dict]:
    for rank, res in enumerate(ranks):
        if "error" in res[job]:
            pytest.fail(f"{job}, rank {rank} raised:\n{res[job]['error']}")
    return [res[job] for res in ranks]


def _assert_state(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("mode", MODES)
def test_a_gan_and_a_distillation_train_like_one_process(ranks, mode):
    """Losses of every step and every parameter of all four models match one process; the
    frozen teacher is unchanged; no gradient is left after the loops' ``zero_grad``."""
    plain = reference_two_models(WORLD)
    results = _result(ranks, ("two_models", mode))
    want = torch.tensor(plain["losses"])
    assert want.shape == (STEPS, 3)
    for res in results:
        torch.testing.assert_close(torch.tensor(res["losses"]), want, rtol=1e-5, atol=1e-6)
        _assert_state(res["state"], plain["state"])
        assert res["grads_left"] == 0
    initial = {f"teacher.{n}": p for n, p in build()["teacher"].named_parameters()}
    for name, value in initial.items():
        assert torch.equal(results[0]["state"][name], value)
    # the discriminator and the generator moved: the loops trained something
    start = {f"{k}.{n}": p for k, m in build().items() for n, p in m.named_parameters()}
    assert not torch.equal(results[0]["state"]["disc.0.weight"], start["disc.0.weight"])
    assert not torch.equal(results[0]["state"]["gen.2.weight"], start["gen.2.weight"])
    if mode == "compiled":
        assert results[0]["graphs"] >= 4  # every model ran through its compiled graphs


@pytest.mark.parametrize("how", BLOCK_COMPILES)
def test_decoder_layers_compiled_one_by_one_train_like_one_process(ranks, how):
    """``layer.compile(backend="graphshard")`` on each layer of a sharded Hugging Face Llama
    (or ``torch.compile(layer, ...)`` put back in the ``ModuleList``): each layer's graph
    gathers and reduces its own parameters, the rest of the model reads its shards eagerly,
    and training matches one process."""
    plain = reference_block_compile(WORLD)
    for res in _result(ranks, ("block_compile", how)):
        assert len(res["losses"]) == LLAMA_STEPS
        torch.testing.assert_close(res["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
        _assert_state(res["state"], plain["state"])
        assert res["graphs"] >= 1 and res["breaks"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_mixtures_of_experts_whose_ranks_route_differently_train_like_one_process(ranks, mode):
    """Hugging Face's Mixtral with its loop over the experts hit (eagerly: it reads the stacked
    expert weights once per expert hit, and the ranks hit different numbers of experts; each
    read gathered, so the ranks' gathers paired wrongly and gloo aborted), and a mixture that
    calls every expert of a ``ModuleList`` on its rows, some of them none on rank 1 (eager
    and compiled): losses and parameters match one process."""
    plain = reference_experts(WORLD)
    results = _result(ranks, ("experts", mode))
    assert len(results[0]["hits"]) != len(results[1]["hits"]), results  # 11 and 8 experts
    assert results[0]["unused"] == [] and results[1]["unused"] != [], results
    for res in results:
        assert len(res["losses"]) == EXPERT_STEPS
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(plain["losses"]),
                                   rtol=1e-5, atol=1e-6)
        _assert_state(res["state"], plain["state"])


@pytest.mark.parametrize("mode", RNN_MODES)
def test_torchs_recurrent_layers_train_like_one_process_compiled_or_not(ranks, mode):
    """``nn.LSTM`` and ``nn.GRU`` read their weights in ``forward`` through ``getattr``.
    Compiled, Dynamo runs them (and the forward calling them) eagerly, and each read started
    a Dynamo frame of graphshard's ``__getattr__``: a graph gathering one plain local shard,
    which the backend refused as an unsharded parameter. Now such reads run eagerly, train
    like one process, and warn once per layer class that they ran outside every graph; with
    ``allow_rnn`` Dynamo traces the layers, and nothing warns (torch 2.11's re-reads their
    weights eagerly after the graph, to rebuild ``_flat_weights``, and the warning says so)."""
    plain = reference_recurrent(WORLD)
    for res in _result(ranks, ("recurrent", mode)):
        assert len(res["losses"]) == RNN_STEPS
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(plain["losses"]),
                                   rtol=1e-5, atol=1e-6)
        _assert_state(res["state"], plain["state"])
        if mode == "compiled":
            assert any(m.startswith("LSTM read its parameter 'lstm.weight_ih_l0' eagerly")
                       and "allow_rnn = True" in m for m in res["warned"]), res["warned"]
            assert any(m.startswith("GRU read") for m in res["warned"]), res["warned"]
        elif mode == "eager" or installed_torch_version() >= (2, 13):
            assert res["warned"] == [], res["warned"]
        else:  # torch 2.11's Dynamo re-reads the weights eagerly after the graph, and says so
            assert all("2.13 and later trace it whole" in m for m in res["warned"]), res["warned"]


@pytest.mark.parametrize("optimizer", ROLLOUT_OPTIMIZERS)
def test_an_rl_step_inside_unshard_samples_and_trains_like_one_process(ranks, optimizer):
    """``graphshard.unshard(model)`` around an RL step of a Hugging Face Llama: greedy
    samples (rank 1 decodes one step more than rank 0: no collective runs while the held
    copies serve), a training step on them, then scores and samples again. Every value
    matches one process: the samples, the trained parameters, and the scores and samples
    after the step (the held copies, stale after it, were gathered again), with torch's SGD
    through the DTensors and with fused AdamW run on the local shards. Gathers inside the
    hold, after its own: one per bucket for the training forward (a held copy has no
    autograd history) and one after the step; none while decoding (and in the backward at
    most one per bucket, for what the training forward let go)."""
    plain = reference_rollout(WORLD, optimizer)
    for rank, res in enumerate(_result(ranks, ("rollout", optimizer))):
        assert res["samples"].shape[1] == 4 + 3 + rank
        assert torch.equal(res["samples"], plain["samples"][rank])
        _assert_state(res["state"], plain["state"])
        torch.testing.assert_close(res["logits"], plain["logits"][rank], rtol=1e-4, atol=1e-5)
        assert torch.equal(res["again"], plain["again"][rank])
        assert res["held"] == res["params"]
        assert res["gathers"] == 2 * res["buckets"], res["gathers"]
        assert 0 < res["backward_gathers"] <= res["buckets"]  # what the forward let go
        assert res["buckets"] < res["params"]


def test_muon_steps_the_shards_as_on_fsdp2s_parameters(ranks):
    """torch's Muon (Newton-Schulz on each 2-D weight, run by DTensor on the sharded matrix)
    gives graphshard's parameters exactly what it gives FSDP2's; both are within the rounding
    of its bf16 iterations of one process (which runs them on the whole matrices)."""
    plain = reference_muon(WORLD)
    start = {name: p.detach() for name, p in muon_model().named_parameters()}
    for res in _result(ranks, ("muon", "eager")):
        ours, theirs = res["graphshard"], res["fsdp2"]
        assert len(ours["losses"]) == MUON_STEPS
        assert ours["losses"] == theirs["losses"]
        for name, value in theirs["state"].items():
            assert torch.equal(ours["state"][name], value), name
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(plain["losses"]),
                                   rtol=1e-3, atol=0)
        for name, value in plain["state"].items():
            torch.testing.assert_close(ours["state"][name], value, rtol=0, atol=5e-3,
                                       msg=lambda m, name=name: f"{name}: {m}")
            assert not torch.equal(value, start[name])  # it trained


def test_a_compiled_optimizer_step_trains_like_the_plain_models_and_is_counted(one_rank):
    """torch's recipe ``step = torch.compile(optimizer.step)``: graphshard's step pre-hook
    runs outside the compiled step (under Dynamo its bookkeeping of weak references turned
    into the referents, and the second step raised ``'ShardState' object is not
    callable``), still counts every step, and the shards train as the plain model does."""
    from graph_utils import TwoBlock

    from graphshard.records import STATE_ATTR

    def train(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        step = torch.compile(opt.step)
        for i in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            model(x).pow(2).mean().backward()
            step()
            opt.zero_grad()
        return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
                for n, p in model.named_parameters()}

    torch.manual_seed(0)
    want = train(TwoBlock())
    torch.manual_seed(0)
    model = graphshard.shard(TwoBlock())
    got = train(model)
    _assert_state(got, want)
    assert getattr(model, STATE_ATTR).optimizer_steps == 3
