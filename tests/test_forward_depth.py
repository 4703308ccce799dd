"""Where a sharded model counts its running forwards (``graphshard.api.forward_depth``): hooks
on the root only, every other module holding parameters in its class's ``forward``, so that
Dynamo guards no hook of graphshard's on a submodule and a submodule called on its own still
gathers."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import graphshard
from graphshard.api.forward_depth import DEPTH_HOOK_ATTR
from graphshard.api.sharding import shard_state
from graphshard.models.llama import Llama, LlamaConfig


def _pair() -> tuple[Llama, Llama]:
    torch.manual_seed(0)
    reference = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, ffn_hidden=48,
                                  max_seq_len=8))
    return reference, graphshard.shard(copy.deepcopy(reference))


def _depth_hooks(module: nn.Module) -> list:
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return [hook for hook in hooks if getattr(hook, DEPTH_HOOK_ATTR, False)]


def test_only_the_root_counts_with_hooks_and_a_submodule_alone_still_gathers(one_rank):
    reference, model = _pair()
    assert len(_depth_hooks(model)) == 2
    assert not [name for name, sub in model.named_modules() if sub is not model
                and (sub._forward_pre_hooks or sub._forward_hooks)]
    block, plain_block = model.layers[0], reference.layers[0]
    h = torch.randn(2, 8, 32)
    cos, sin = reference.rope(8)
    torch.testing.assert_close(block(h, cos, sin), plain_block(h, cos, sin))  # gathered
    torch.testing.assert_close(model.output(h), reference.output(h))
    assert shard_state(model).forward_depth == 0
    assert isinstance(model.output.weight, DTensor)  # outside a forward again: the shard


def test_an_error_in_a_submodule_unwinds_the_count(one_rank):
    _, model = _pair()
    with pytest.raises(RuntimeError):
        model.output(torch.randn(2, 8, 5))  # wrong width, called alone
    assert shard_state(model).forward_depth == 0
    with pytest.raises(IndexError):  # inside the model's forward, in a sharded submodule
        model(torch.randint(64, 128, (2, 8)))  # token ids past the vocabulary
    assert shard_state(model).forward_depth == 0
    with pytest.raises(ValueError, match="max_seq_len"):  # inside it, in the rotary tables
        model(torch.randint(0, 64, (2, 9)))  # longer than the rotary tables
    assert shard_state(model).forward_depth == 0
    assert isinstance(model.output.weight, DTensor)


def test_a_submodule_whose_forward_is_an_instance_attribute_is_counted_by_hooks(one_rank):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    patched = copy.deepcopy(reference)
    first = patched[0]
    first.forward = lambda x: nn.functional.linear(x, first.weight, first.bias) * 2
    model = graphshard.shard(patched)
    assert len(_depth_hooks(model[0])) == 2 and not _depth_hooks(model[1])
    x = torch.randn(3, 4)
    torch.testing.assert_close(model[0](x), reference[0](x) * 2)
    torch.testing.assert_close(model(x), reference[1](reference[0](x) * 2))
    assert shard_state(model).forward_depth == 0


def test_a_submodules_forward_keeps_its_signature_and_class(one_rank):
    reference, model = _pair()
    assert type(model.layers) is nn.ModuleList  # never called: nothing to count
    for (name, plain), sub in zip(reference.named_modules(), model.modules(), strict=True):
        assert isinstance(sub, type(plain)), name
        assert inspect.signature(sub.forward) == inspect.signature(plain.forward), name


def test_dynamo_guards_no_hook_of_a_submodule(fake2):
    """A hook pair on every submodule cost about 14 guards each, checked before every call
    of the compiled step (and torch 2.11 stopped skipping them after any later compile)."""
    _, model = _pair()
    tokens = torch.randint(0, 64, (2, 8))
    torch.compile(model, backend=graphshard.backend(inductor=False))(tokens, tokens)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    (entry,) = _debug_get_cache_entry_list(type(model).forward.__code__)
    guards = str(entry.guard_manager)
    assert "_forward_pre_hooks" in guards  # the root's, and empty dicts of the others
    assert "_graphshard_counts_forward_depth" not in guards
    assert "L['self']._modules['layers']._modules['0']._forward_hooks_always_called" \
        not in guards.replace('"', "'")
