"""``graphshard.api.optimizer_steps``: torch's Adafactor and Rprop step graphshard's sharded
parameters (on DTensor alone they raise). Their numerics against one process are in
``test_torch_idioms.py`` (world 2, world 3, HSDP 2x2). Here: Adafactor's factored state stays
sharded like the gradient and survives a DCP checkpoint (world 3: uneven rows, a rank with
none) and ``graphshard.save_checkpoint`` loaded at world 2, and the handlers serve only the
steps they are for."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp
from dist_utils import full_state, run_ranks
from idioms_jobs import OTHER_SEED, batch, build, loss_fn
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

import graphshard
from graphshard.api import optimizer_steps
from graphshard.state import checkpoint

HANDLERS = DTensor._op_dispatcher._custom_op_handlers
SAVE_AT, MORE_STEPS = 2, 2


def _adafactor(model: nn.Module, foreach: bool) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(model.parameters(), lr=0.05, foreach=foreach)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int) -> list:
    losses = []
    for step in steps:
        loss = loss_fn(model, batch(step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _even_step_collectives(foreach: bool) -> dict[str, int]:
    """The collectives of one Adafactor step (torch's ``CommDebugMode``) on a layer whose
    rows split evenly over 3 ranks (rows fewer than the ranks, or uneven ones, gather a
    row factor, or such a layer's whole few rows, where DTensor cannot keep them sharded)."""
    torch.manual_seed(0)
    layer = graphshard.shard(nn.Linear(12, 9))
    opt = _adafactor(layer, foreach)
    layer(torch.randn(4, 12)).sum().backward()
    with CommDebugMode() as comms:
        opt.step()
    return {str(op): count for op, count in comms.get_comm_counts().items()}


def _state_layout(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Per parameter: its local rows and placements, and each state tensor's."""
    out = {}
    for name, param in model.named_parameters():
        entry = {"param": (tuple(param.to_local().shape), param.placements, param.shape)}
        for key, value in opt.state[param].items():
            if isinstance(value, DTensor):
                entry[key] = (tuple(value.to_local().shape), value.placements, value.shape)
        out[name] = entry
    return out


def adafactor_job(rank: int, world_size: int, save_dir: str, foreach: bool) -> dict:
    """Train, save model and optimizer through DCP, train on; a fresh model and optimizer
    (another seed) load the checkpoint and train the same steps."""
    torch.manual_seed(0)
    model = graphshard.shard(build())
    opt = _adafactor(model, foreach)
    out = {"first": _train(model, opt, range(SAVE_AT), rank),
           "layout": _state_layout(model, opt), "sent": _even_step_collectives(foreach)}
    checkpoint = f"{save_dir}/foreach{int(foreach)}"
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=checkpoint)
    graphshard.save_checkpoint(f"{checkpoint}-graphshard", model, opt, step=SAVE_AT)
    out["saved_optim"] = _optim_full(model, opt)
    later = range(SAVE_AT, SAVE_AT + MORE_STEPS)
    out["continued"] = _train(model, opt, later, rank)
    out["continued_state"] = full_state(model)

    fresh = graphshard.shard(build(OTHER_SEED))
    fresh_opt = _adafactor(fresh, foreach)
    _train(fresh, fresh_opt, range(1), rank)  # its own state, which the load replaces
    saved = {"model": get_model_state_dict(fresh),
             "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(saved, checkpoint_id=checkpoint)
    set_model_state_dict(fresh, saved["model"])
    set_optimizer_state_dict(fresh, fresh_opt, saved["optim"])
    out["resumed"] = _train(fresh, fresh_opt, later, rank)
    out["resumed_state"] = full_state(fresh)

    # torch's full optimizer state dict, into a fresh optimizer: each factor distributed as
    # a step lays it out
    whole = StateDictOptions(full_state_dict=True)
    other = graphshard.shard(build(OTHER_SEED))
    other_opt = _adafactor(other, foreach)
    set_optimizer_state_dict(other, other_opt,
                             get_optimizer_state_dict(model, opt, options=whole), options=whole)
    out["full_loaded"] = {"optim": _optim_full(other, other_opt),
                          "layout": _state_layout(other, other_opt),
                          "source": _optim_full(model, opt)}
    # a 0-D parameter's loaded state is a plain tensor unless made a DTensor again
    # (graphshard.api.optimizer_state): the single-tensor step then failed on it
    out["full_loaded"]["next"] = _train(other, other_opt, range(1), rank)
    return out


def _optim_full(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The optimizer's state as full plain tensors, by parameter name."""
    return {name: {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                   for k, v in opt.state[param].items()}
            for name, param in model.named_parameters()}


def run_jobs(rank: int, world_size: int, save_dir: str) -> dict:
    return {foreach: adafactor_job(rank, world_size, save_dir, foreach)
            for foreach in (False, True)}


def load_job(rank: int, world_size: int, save_dir: str) -> dict:
    """``graphshard.load_checkpoint`` of world 3's checkpoints into a fresh model and
    Adafactor: the optimizer state read, and a step after it."""
    out = {}
    for foreach in (False, True):
        model = graphshard.shard(build(OTHER_SEED))
        opt = _adafactor(model, foreach)
        graphshard.load_checkpoint(f"{save_dir}/foreach{int(foreach)}-graphshard", model, opt)
        out[foreach] = {"optim": _optim_full(model, opt),
                        "layout": _state_layout(model, opt),
                        "next": _train(model, opt, range(SAVE_AT, SAVE_AT + 1), rank)}
    return out


@pytest.fixture(scope="module")
def save_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("adafactor_dcp"))


@pytest.fixture(scope="module")
def world3(save_dir):
    return run_ranks(run_jobs, 3, save_dir)


@pytest.fixture(scope="module")
def world2_loaded(world3, save_dir):
    return run_ranks(load_job, 2, save_dir)


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_adafactor_row_factor_is_sharded_like_the_gradient_and_column_factor_replicated(
        world3, foreach):
    """A matrix's row factor holds this rank's rows only (DTensor's own ``new_zeros`` would
    replicate it, and every rank would then compute the whole update); the column factor,
    a mean over the sharded rows, is replicated. Vectors keep a variance placed like
    themselves."""
    for ranks_layout in (res[foreach]["layout"] for res in world3):
        for name, entry in ranks_layout.items():
            local, placements, shape = entry["param"]
            if len(shape) >= 2:
                assert entry["row_var"][1] == (Shard(0),), name
                assert entry["row_var"][0] == (*local[:-1], 1), name
                col_rows_kept = len(shape) > 2  # a 3-D tensor's factors both keep dim 0
                assert entry["col_var"][1] == ((Shard(0),) if col_rows_kept else (Replicate(),))
                assert entry["col_var"][2] == (*shape[:-2], 1, shape[-1]), name
            elif len(shape) == 1:
                assert entry["variance"][:2] == (local, placements), name


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_an_adafactor_step_sends_only_the_factors_reductions(world3, foreach):
    """Nothing is gathered (DTensor's own placement of the factors gathers the row factor
    and the whole gradient): the step's collectives are all-reduces, of the column means,
    the row factor's mean and the norms."""
    for res in world3:
        sent = res[foreach]["sent"]
        assert set(sent) == {"c10d_functional.all_reduce"}, sent


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_adafactor_resumes_from_a_dcp_checkpoint_bit_for_bit(world3, foreach):
    for res in world3:
        run = res[foreach]
        assert run["resumed"] == run["continued"]
        for key, value in run["continued_state"].items():
            assert torch.equal(run["resumed_state"][key], value), key


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_graphshard_checkpoint_of_adafactor_loads_at_another_world_size(world3, world2_loaded,
                                                                        foreach):
    """Saved at world 3, loaded at world 2: the factors keep their reduced shapes (not the
    parameter's, which the load once expected of every sharded entry) and their values,
    and are laid out on the new mesh as a step lays them out."""
    saved = world3[0][foreach]["saved_optim"]
    for res in world2_loaded:
        loaded = res[foreach]["optim"]
        assert loaded.keys() == saved.keys()
        for name, state in saved.items():
            assert loaded[name].keys() == state.keys(), name
            for key, value in state.items():
                assert torch.equal(loaded[name][key], value), (name, key)
        assert res[foreach]["layout"]["fc1.weight"]["row_var"][1] == (Shard(0),)
        assert res[foreach]["layout"]["fc1.weight"]["col_var"][1] == (Replicate(),)
        assert all(map(math.isfinite, res[foreach]["next"]))


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
def test_a_full_optimizer_state_dict_loads_into_a_fresh_adafactor(world3, foreach):
    for res in world3:
        run = res[foreach]["full_loaded"]
        assert run["optim"].keys() == run["source"].keys()
        for name, state in run["source"].items():
            for key, value in state.items():
                assert torch.equal(run["optim"][name][key], value), (name, key)
        assert run["layout"] == res[foreach]["layout"]  # placements and local shapes
        assert all(map(math.isfinite, run["next"]))


def test_a_reduced_state_must_keep_its_parameters_other_dimensions():
    assert checkpoint._reduced_from((30, 1), (30, 13))
    assert checkpoint._reduced_from((1, 13), (30, 13))
    assert not checkpoint._reduced_from((31, 1), (30, 13))
    assert not checkpoint._reduced_from((30,), (30, 13))


# ----------------------------------------------------------------------- where they serve


class _Recording(torch.optim.Adafactor):
    """Adafactor that records, inside its step, which of graphshard's handlers are on."""

    def step(self, closure=None):
        self.seen = {op for op, h in HANDLERS.items() if h in _OURS}
        return super().step(closure)


_OURS = set(optimizer_steps._handlers().values())


def _ours_on() -> set:
    return {op for op, handler in HANDLERS.items() if handler in _OURS}


def _stepped(optimizer: torch.optim.Optimizer, params) -> None:
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()


def test_the_handlers_serve_only_steps_over_graphshards_parameters(one_rank):
    sharded = graphshard.shard(nn.Linear(4, 3))
    plain = nn.Linear(4, 3)
    for model, expected in ((sharded, True), (plain, False)):
        opt = _Recording(model.parameters())
        _stepped(opt, model.parameters())
        assert bool(opt.seen) is expected
        if expected:
            assert torch.ops.aten.linalg_vector_norm.default in opt.seen
        assert not _ours_on()  # removed after the step
    sgd = torch.optim.SGD(sharded.parameters(), lr=0.1)
    _stepped(sgd, sharded.parameters())
    assert not _ours_on()


def test_a_step_that_raises_leaves_the_handlers_to_the_next_step(one_rank):
    model = graphshard.shard(nn.Linear(4, 3))
    opt = torch.optim.Rprop(model.parameters())

    def closure():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        opt.step(closure)
    assert _ours_on()  # torch skips the post-hooks of a step that raised
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    other.step()
    assert not _ours_on()
