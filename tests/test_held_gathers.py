"""``graphshard.unshard(model)`` (:mod:`graphshard.api.held_gathers`) on a fake group of 2
ranks: the gathers are counted as they are dispatched (their values are checked on real
ranks, ``test_training_loops.py``'s rollout job). A Hugging Face Llama generates, as in an
RL rollout."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphshard
from graphshard.api.sharding import shard_state
from graphshard.errors import GraphshardRuntimeError, ShardedModelError
from graphshard.passes.markers import UNSHARD

_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default

transformers = pytest.importorskip("transformers")


class Gathers(TorchDispatchMode):
    """Counts the eager all-gathers dispatched while active: ``graphshard::unshard`` (one
    parameter's) and a bucket's (``graphshard.api.bucket_gathers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is UNSHARD or func is _ALL_GATHER
        return func(*args, **(kwargs or {}))


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return graphshard.shard(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)))


def _generate(model: nn.Module, new_tokens: int = 3) -> torch.Tensor:
    prompt = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)


def _parameter_count(model: nn.Module) -> int:
    return len(list(model.parameters()))


def _buckets(model: nn.Module, leaving: list[str] = ()) -> int:
    """The buckets of ``model`` (one all-gather each) that hold a parameter not named in
    ``leaving``."""
    return len({e.bucket for e in shard_state(model).params if e.names[0] not in leaving})


def test_a_held_model_generates_without_gathering(fake2):
    """Without the hold every decoding step gathers every bucket again (one collective a
    bucket, not one a parameter); with it, the hold gathers each bucket once and generation
    gathers nothing."""
    model = _llama()
    with Gathers() as unheld:
        _generate(model)
    assert 1 < _buckets(model) < _parameter_count(model)
    assert unheld.count == 3 * _buckets(model)
    with Gathers() as holding:
        held = graphshard.unshard(model)
    with Gathers() as generating:
        _generate(model)
    assert holding.count == _buckets(model)
    assert len(held.parameter_names) == _parameter_count(model)
    assert generating.count == 0
    held.reshard()
    assert shard_state(model).held_gathered == {}
    with Gathers() as after:
        _generate(model, new_tokens=1)
    assert after.count == _buckets(model)  # gathering per call again


def test_a_read_that_trains_gathers_as_always(fake2):
    model = _llama()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    with graphshard.unshard(model), Gathers() as training:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert training.count == _buckets(model)
    assert all(p.grad is not None for p in model.parameters())


def test_an_updated_shard_is_gathered_again_at_its_next_read(fake2):
    """An in-place update of shards inside the hold (what an optimizer step does): the
    next forward gathers what changed, once, and the one after it nothing."""
    model = _llama()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    state = shard_state(model)
    with graphshard.unshard(model):
        norm = model.model.norm.weight
        with torch.no_grad():
            norm.mul_(2.0)
            with Gathers() as first:
                model(input_ids=ids)
            with Gathers() as second:
                model(input_ids=ids)
        assert first.count >= 1 and second.count == 0
        held = state.held_gathered["model.norm.weight"]
        assert held.is_current(norm, state.optimizer_steps)


def test_a_held_copy_written_in_place_is_refused_at_reshard(fake2):
    model = _llama()

    def scale_in_place(module: nn.Module, args: tuple) -> None:
        module.weight.mul_(2.0)  # the held copy, under no_grad: the write would be lost

    model.model.norm.register_forward_pre_hook(scale_in_place)
    held = graphshard.unshard(model)
    _generate(model, new_tokens=1)
    with pytest.raises(ShardedModelError, match="In-place update on parameter 'model.norm.weight'"):
        held.reshard()
    assert shard_state(model).held_gathered == {}


def test_holds_nest_and_an_error_lets_go(fake2):
    """A hold inside another gathers only what the outer one does not hold, and its end
    leaves the outer one's copies; an error unwinding a hold lets go of its copies."""
    model = _llama()
    state = shard_state(model)
    with graphshard.unshard(model.model.layers[0]) as inner:
        with Gathers() as outer_gathers, graphshard.unshard(model) as outer:
            assert outer_gathers.count == _buckets(model, leaving=inner.parameter_names)
            assert len(outer.parameter_names) == (_parameter_count(model)
                                                  - len(inner.parameter_names))
            with graphshard.unshard(model.model.layers[0]) as again:
                assert again.parameter_names == []
            assert len(state.held_gathered) == _parameter_count(model)
        assert sorted(state.held_gathered) == sorted(inner.parameter_names)
        assert set(outer.parameter_names).isdisjoint(inner.parameter_names)
    assert state.held_gathered == {}
    with pytest.raises(ValueError, match="raised inside"):
        with graphshard.unshard(model):
            raise ValueError("raised inside")
    assert state.held_gathered == {}


def test_a_failed_hold_holds_nothing(fake2, monkeypatch):
    """A hold whose gathering fails part way (here the fifth parameter's) leaves none of
    the parameters gathered before it held; a model on the meta device is refused with what
    to do."""
    from graphshard.api import held_gathers

    model = _llama()
    calls = []

    def failing(*args):
        calls.append(args)
        if len(calls) == 5:
            raise RuntimeError("the fifth gather failed")
        return gather(*args)

    gather = held_gathers.gathered_param
    monkeypatch.setattr(held_gathers, "gathered_param", failing)
    with pytest.raises(RuntimeError, match="the fifth gather failed"):
        graphshard.unshard(model)
    assert shard_state(model).held_gathered == {}
    with torch.device("meta"):
        meta = _llama()
    with pytest.raises(ShardedModelError, match="still on the meta device"):
        graphshard.unshard(meta)


def test_unshard_refuses_a_module_without_sharded_parameters(fake2):
    with pytest.raises(GraphshardRuntimeError, match="holds no sharded parameter"):
        graphshard.unshard(nn.Linear(4, 4))


def test_unshard_refuses_to_be_traced(fake2):
    model = _llama()

    def step(ids: torch.Tensor) -> torch.Tensor:
        with graphshard.unshard(model):
            return model(input_ids=ids).logits

    compiled = torch.compile(step, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="cannot be traced"):
        compiled(torch.zeros(1, 3, dtype=torch.long))
