"""What a block may be called with and still compile once (``compile_blocks_once``).

A block called with an object (a cache, a list, a dict) runs inline with a warning: its body
may change the object, and torch's compile regions cannot replay every such change (a
stored tensor aliasing a region input ends the compile with an internal Dynamo error on
every torch from 2.11 to 2.14). Blocks called with tensors and plain values, tuples of them
included, stay regions. Numerics against the unsharded model run eagerly (one real gloo rank).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from dist_utils import compiled_backward
from torch import nn

import graphshard
from graphshard.api import block_regions
from graphshard.api.block_regions import BlockInlinedWarning
from graphshard.passes.regions import region_calls


class _Store:
    """A cache-like object that blocks write to: a tensor made before the step, which each
    block moves to its input's device (a no-op here, so the stored tensor aliases the
    region's input), as Hugging Face's sliding-window cache layers do."""

    def __init__(self) -> None:
        self.window = torch.tensor(3)
        self.calls = 0


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, rotation: tuple[torch.Tensor, torch.Tensor],
                store: _Store | None = None) -> torch.Tensor:
        if store is not None:
            store.window = store.window.to(x.device)
            store.calls += 1
        cos, sin = rotation
        return x + self.down(torch.relu(self.up(x * cos + sin)))


class _Stack(nn.Module):
    def __init__(self, with_store: bool) -> None:
        super().__init__()
        self.with_store = with_store
        self.stem = nn.Linear(8, 8)  # (the blocks' input then requires grad in every one)
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.store: _Store | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rotation = (torch.linspace(0.5, 1.5, 8), torch.linspace(-0.1, 0.1, 8))
        self.store = _Store() if self.with_store else None
        x = self.stem(x)
        for block in self.blocks:
            x = block(x, rotation, store=self.store)
        return x.square().mean()


def _compiled_backward(with_store: bool) -> tuple[nn.Module, nn.Module, list, dict]:
    """(reference run eagerly, sharded copy compiled, warnings raised, the backend's step
    graphs), one backward each on the same input."""
    torch.manual_seed(0)
    reference, model, backend, caught = compiled_backward(lambda: _Stack(with_store),
                                                          torch.randn(4, 8))
    (stages,) = backend.graphs
    return reference, model, [w for w in caught if w.category is BlockInlinedWarning], stages


def _assert_same_gradients(reference: nn.Module, model: nn.Module) -> None:
    for (name, want), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, msg=name)


def test_a_block_called_with_an_object_it_changes_compiles_inline(one_rank, monkeypatch):
    """As a region this fails to compile (Dynamo: "An intermediate tensor ... aliases an input
    or output"); inline it trains like the eager model, the object's changes replayed."""
    monkeypatch.setattr(block_regions, "_INLINED_NOTED", set())
    reference, model, caught, stages = _compiled_backward(with_store=True)
    assert not list(region_calls(stages["fw"]))
    _assert_same_gradients(reference, model)
    assert model.store.calls == 3 and isinstance(model.store.window, torch.Tensor)
    (warning,) = caught  # one per kind of block, not one per block
    message = str(warning.message)
    assert "_Block blocks are compiled inline" in message
    assert "keyword argument 'store' is a _Store" in message
    assert "use_cache=False" in message  # what to change


def test_a_block_called_with_tensors_and_tuples_of_them_stays_a_region(one_rank, monkeypatch):
    monkeypatch.setattr(block_regions, "_INLINED_NOTED", set())
    reference, model, caught, stages = _compiled_backward(with_store=False)
    assert len(list(region_calls(stages["fw"]))) == 3
    assert not caught
    _assert_same_gradients(reference, model)


@pytest.mark.parametrize("operand,inline", [
    (torch.ones(2), False), (None, False), (3, False), (0.5, False), ("causal", False),
    (torch.float32, False), ((torch.ones(2), (1, None)), False),
    ([torch.ones(2)], True), ({"mask": torch.ones(2)}, True), ((torch.ones(2), _Store()), True),
    (_Store(), True),
])
def test_which_operands_keep_a_block_a_region(operand, inline):
    assert (block_regions._object_operand((operand,), {}) is not None) is inline
    assert (block_regions._object_operand((), {"name": operand}) is not None) is inline


def test_hugging_face_mistral_with_its_cache_trains_compiled(one_rank, monkeypatch):
    """Mistral's decoder layers take the ``DynamicCache`` that ``use_cache`` (on by default)
    builds; its sliding-window layers store a tensor moved with ``.to(device)``. As regions
    this failed to compile on every torch checked; it now trains like the eager model, and
    ``use_cache=False`` gives the regions back."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(block_regions, "_INLINED_NOTED", set())
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation="sdpa")
    torch.manual_seed(0)
    reference = transformers.MistralForCausalLM(config)
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model = graphshard.shard(copy.deepcopy(reference))
    reference(input_ids=tokens, labels=tokens).loss.backward()
    for use_cache, regions in ((True, 0), (False, 2)):
        backend = graphshard.backend(inductor=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = torch.compile(model, backend=backend)
            compiled(input_ids=tokens, labels=tokens, use_cache=use_cache).loss.backward()
        assert len(list(region_calls(backend.graphs[-1]["fw"]))) == regions
        assert any(w.category is BlockInlinedWarning for w in caught) is use_cache
        _assert_same_gradients(reference, model)
        model.zero_grad()
        torch._dynamo.reset()


class _KeywordBlock(nn.Module):
    """A block whose keyword arguments are named as graphshard's wrappers name their own
    (Hugging Face's RWKV blocks take ``state=``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, fn: str = "relu",
                forward: int = 1) -> torch.Tensor:
        out = getattr(torch, fn)(self.proj(x)) * forward
        return out if state is None else out + state


class _KeywordStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_KeywordBlock() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        state = torch.full_like(x, 0.5)
        for block in self.blocks:
            x = block(x, state=state, fn="tanh", forward=2)
        return x.square().mean()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_blocks_keyword_arguments_may_have_any_name(one_rank, compiled):
    """Keywords named ``state``, ``fn`` and ``forward`` reach the block's own ``forward``
    (before, the eager forward counter took ``state`` as its own argument: "counted_call()
    got multiple values for argument 'state'")."""
    torch.manual_seed(0)
    reference, x = _KeywordStack(), torch.randn(4, 8)
    model = graphshard.shard(copy.deepcopy(reference))
    reference(x).backward()
    run = torch.compile(model, backend=graphshard.backend(inductor=False)) if compiled else model
    run(x).backward()
    _assert_same_gradients(reference, model)
