"""Block regions given a conjugate view: Hugging Face's Llama 4 multiplies its queries and
keys by complex rotary tables, so every block's backward takes the table's conjugate, which
AOTAutograd computes once outside the blocks as a view with the conjugate bit. torch's
``invoke_subgraph`` has no kernel for that bit (nor for the negative one, which a model can
pass its blocks itself); graphshard hands the regions a clone
(``graphshard/passes/region_conj.py``), and the blocks stay regions, compiled once."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch import fx

import graphshard
from graphshard.passes import Plan, resolve_region_operand_views
from graphshard.passes.regions import region_calls


def _llama4() -> torch.nn.Module:
    from bench import architectures

    pytest.importorskip("transformers")
    return architectures.build("llama4")


def _operand_values(gm: fx.GraphModule) -> list[torch.Tensor]:
    return [a.meta["val"] for call in region_calls(gm) for a in call.args[2:]
            if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def test_llama4s_complex_rotary_blocks_stay_regions_and_train_like_eager(one_rank):
    """The graphs run as traced (``inductor=False``), where the region call fails the same
    way as in Inductor and in a fifth of the time; ``python -m bench.architectures --models
    llama4`` trains it through Inductor on 2 ranks."""
    reference = _llama4()
    model = graphshard.shard(copy.deepcopy(reference))
    backend = graphshard.backend(inductor=False)
    compiled = torch.compile(model, backend=backend)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    for step in range(2):
        compiled(input_ids=ids, labels=ids).loss.backward()
        reference(input_ids=ids, labels=ids).loss.backward()
        for (name, want), got in zip(reference.named_parameters(), model.parameters(),
                                     strict=True):
            torch.testing.assert_close(got.grad.full_tensor(), want.grad, rtol=1e-5,
                                       atol=1e-6, msg=f"step {step}: {name}")
        model.zero_grad()
        reference.zero_grad()
    (graphs,) = backend.graphs
    # the rotary layers share one region; the last layer, without rotary, is a block of
    # its own (a region of its own on torch 2.11; inlined by torch 2.13's Dynamo, as a
    # region called once: inline_single_use_invoke_subgraph)
    layers = sum(bool(layer.self_attn.use_rope) for layer in reference.model.layers)
    assert layers == 3
    for stage in ("fw", "bw"):
        bodies = Counter(call.args[1] for call in region_calls(graphs[stage]))
        assert max(bodies.values()) == layers, (stage, bodies)
        values = _operand_values(graphs[stage])
        assert values and not any(v.is_conj() or v.is_neg() for v in values), stage
    # the backward's conjugate table, one view: cloned once, read by every block
    clones = [n for n in graphs["bw"].graph.nodes if n.target is torch.ops.aten.clone.default
              and n.args[0].meta["val"].is_conj()]
    assert len(clones) == 1 and len(clones[0].users) == layers, clones


def test_the_pass_clones_each_lazy_view_once_before_its_first_region(fake2):
    """On a graph as AOTAutograd gives it (the bw graph of the sharded Llama 4, its pass
    undone): one clone per conjugate view, placed before the first call that reads it, and
    the other operands untouched."""
    model = graphshard.shard(_llama4())
    backend = graphshard.backend(inductor=False)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss.backward()
    bw = backend.graphs[0]["bw"]
    for clone in [n for n in bw.graph.nodes if n.target is torch.ops.aten.clone.default
                  and n.args[0].meta["val"].is_conj()]:  # undo it
        clone.replace_all_uses_with(clone.args[0])
        bw.graph.erase_node(clone)
    before = [list(call.args) for call in region_calls(bw)]
    assert any(v.is_conj() for v in _operand_values(bw))
    resolve_region_operand_views(bw, Plan())
    bw.graph.lint()
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    calls = list(region_calls(bw))
    for call, old in zip(calls, before, strict=True):
        for new_arg, old_arg in zip(call.args, old, strict=True):
            if new_arg is old_arg:
                continue
            assert new_arg.target is torch.ops.aten.clone.default
            assert new_arg.args[0] is old_arg and old_arg.meta["val"].is_conj()
            assert not new_arg.meta["val"].is_conj()
            assert order[new_arg] < min(order[c] for c in new_arg.users)
    assert not any(v.is_conj() or v.is_neg() for v in _operand_values(bw))


class _ScaledBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x) * scale))


class _NegativeViewModel(torch.nn.Module):
    """Every block is called with the imaginary part of a conjugate: a view with the
    negative bit, which ``invoke_subgraph`` has no kernel for either."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.layers = torch.nn.ModuleList(_ScaledBlock() for _ in range(3))
        self.register_buffer("table", torch.randn(4, dtype=torch.cfloat), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, scale = self.embed(tokens), self.table.conj().imag
        for layer in self.layers:
            x = layer(x, scale)
        return x.square().mean()


def test_blocks_called_with_a_negative_view_train_like_eager(one_rank):
    torch.manual_seed(0)
    reference = _NegativeViewModel()
    model = graphshard.shard(copy.deepcopy(reference))
    backend = graphshard.backend(inductor=False)
    tokens = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    torch.compile(model, backend=backend)(tokens).backward()
    reference(tokens).backward()
    for (name, want), got in zip(reference.named_parameters(), model.parameters(),
                                 strict=True):
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, msg=name)
    (graphs,) = backend.graphs
    assert len(list(region_calls(graphs["fw"]))) == 3
    assert not any(v.is_neg() or v.is_conj() for v in _operand_values(graphs["fw"]))
