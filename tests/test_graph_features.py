"""Graph-level behaviour on ordinary modules: inference, frozen parameters, graph breaks."""

from __future__ import annotations

import warnings

import pytest
import torch
from graph_utils import Breaks, TwoBlock, c10d, calls
from torch import nn

import graphshard
from graphshard.passes.layout import Dim0Layout

AG, RS = c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default


def test_no_grad_forward_gathers_and_never_reduces(fake2):
    backend = graphshard.backend(inductor=False)
    model = torch.compile(graphshard.shard(TwoBlock()), backend=backend)
    with torch.no_grad():
        model(torch.randn(4, 8))
    (stages,) = backend.graphs
    assert set(stages) == {"dynamo", "inference"}
    assert len(calls(stages["inference"], AG)) == 3
    assert calls(stages["inference"], RS) == []


def test_frozen_parameters_are_gathered_but_never_reduced(fake2):
    model = TwoBlock()
    model.blocks[0].up.requires_grad_(False)
    graphshard.shard(model)
    backend = graphshard.backend(inductor=False, reshard_last_bucket=True)
    torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
    (stages,) = backend.graphs
    first_gather = calls(stages["fw"], AG)[0]
    assert "blocks.0.up.weight" in first_gather.meta["graphshard"]["params"]
    reduced = [n for rs in calls(stages["bw"], RS) for n in rs.meta["graphshard"]["params"]]
    assert "blocks.0.up.weight" not in reduced and "blocks.0.up.bias" not in reduced
    assert "blocks.0.down.weight" in reduced
    trainable = [p for p in TwoBlock().parameters()][2:]  # all but blocks.0.up
    rs_numel = sum(rs.args[0].meta["val"].numel() for rs in calls(stages["bw"], RS))
    assert rs_numel == 2 * sum(Dim0Layout(p.shape, 2).piece_numel for p in trainable)
    assert dict(model.named_parameters())["blocks.0.up.weight"].grad is None


def test_each_graph_of_a_graph_break_gathers_only_what_it_uses(fake2):
    backend = graphshard.backend(inductor=False)
    model = graphshard.shard(Breaks())
    torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
    assert len(backend.graphs) == 2
    gathered = [
        [n for g in calls(stages["fw"], AG) for n in g.meta["graphshard"]["params"]]
        for stages in backend.graphs
    ]
    assert all(name.startswith("blocks.0.") for name in gathered[0])
    assert {n for n in gathered[1] if not n.startswith("blocks.1.")} == {"head.weight", "head.bias"}
    assert any(n.startswith("blocks.1.") for n in gathered[1])
    reduced = [
        n for stages in backend.graphs for rs in calls(stages["bw"], RS)
        for n in rs.meta["graphshard"]["params"]
    ]
    assert sorted(reduced) == sorted(name for name, _ in Breaks().named_parameters())


def test_buffers_stay_whole_and_out_of_collectives(fake2):
    model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    graphshard.shard(model)
    assert model[1].running_mean.shape == (6,)
    backend = graphshard.backend(inductor=False)
    torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
    (stages,) = backend.graphs
    names = [n for g in calls(stages["fw"], AG) for n in g.meta["graphshard"]["params"]]
    assert not any("running" in n or "num_batches" in n for n in names)


class _Convs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Conv2d(4, 4, 3, padding=1) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x).relu()
        return self.head(x.mean((2, 3)))


def test_channels_last_shards_are_gathered_in_row_major_order(fake2):
    """After ``model.to(memory_format=torch.channels_last)`` each convolution's shard has
    channels-last strides; the gather copies it to a contiguous tensor before flattening it
    (before, ``view(-1)`` of the shard failed the compile)."""
    model = graphshard.shard(_Convs()).to(memory_format=torch.channels_last)
    convs = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert all(not w.to_local().is_contiguous() for w in convs)
    backend = graphshard.backend(inductor=False)
    x = torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)
    torch.compile(model, backend=backend)(x).sum().backward()
    (stages,) = backend.graphs
    copies = [n for n in calls(stages["fw"], torch.ops.aten.clone.default)
              if n.kwargs.get("memory_format") == torch.contiguous_format
              and n.args[0].op == "placeholder"]  # a shard entering the step
    assert sorted(tuple(n.args[0].meta["val"].shape) for n in copies) == sorted(
        tuple(w.to_local().shape) for w in convs)
    for gather in calls(stages["fw"], AG):
        assert gather.args[0].meta["val"].is_contiguous()


def _symints(graph: torch.fx.Graph) -> list[str]:
    """Nodes of ``graph`` with a SymInt among their arguments."""
    found = []
    for node in graph.nodes:
        leaves = torch.utils._pytree.tree_leaves((node.args, node.kwargs))
        if any(isinstance(leaf, torch.SymInt) for leaf in leaves):
            found.append(node.format_node())
    return found


def _shard_input_sizes(dynamo: torch.fx.GraphModule) -> dict[str, tuple]:
    """The sizes of the Dynamo graph's inputs that graphshard owns: every parameter's local
    tensor and every bucket's storage."""
    return {n.name: tuple(n.meta["example_value"].shape) for n in dynamo.graph.nodes
            if n.op == "placeholder" and "graphshard" in n.name}


@pytest.mark.parametrize("dynamic", [None, True], ids=["recompiled", "dynamic"])
def test_shard_sizes_stay_static_as_a_parameters_do(dynamic):
    """graphshard's plain local tensors and storages have static sizes in the traced graphs,
    as Dynamo keeps a Parameter's, also where it makes other sizes dynamic: under
    ``dynamic=True``, and for a second model of the same class (``Sequential.forward`` again:
    Dynamo takes the compile for a recompile). Before, their sizes were SymInts there: every
    kernel of the model was compiled for symbolic sizes, and rank 1's padding of its shorter
    shard passed a raw SymInt to a node ("Raw SymInt value ... passed as argument to
    Graph.create_node")."""
    from graph_utils import fake_process_group

    with fake_process_group(2, rank=1):
        torch.manual_seed(0)
        first = graphshard.shard(nn.Sequential(nn.Linear(8, 33), nn.ReLU(), nn.Linear(33, 16)))
        second = graphshard.shard(nn.Sequential(nn.Linear(16, 31), nn.Tanh(), nn.Linear(31, 1)))
        backend = graphshard.backend(inductor=False)
        torch.compile(first, backend=backend, dynamic=dynamic)(torch.randn(4, 8)).sum().backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            source = torch.randn(4, 16, requires_grad=True)
            out = torch.compile(second, backend=backend, dynamic=dynamic)(source * 2)
            out.sum().backward()
    assert len(backend.graphs) == 2
    for stages in backend.graphs:
        sizes = _shard_input_sizes(stages["dynamo"])
        assert len(sizes) == 6, sizes  # two weights, their storages, two biases
        assert all(type(s) is int for shape in sizes.values() for s in shape), sizes
        for stage, gm in stages.items():
            assert _symints(gm.graph) == [], stage
    assert (15, 16) in _shard_input_sizes(backend.graphs[1]["dynamo"]).values()  # rank 1's rows
    assert not [w for w in caught if "Raw SymInt" in str(w.message)]
    assert second[0].weight.grad.to_local().shape == (15, 16)
