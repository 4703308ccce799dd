"""Blocks compiled once whose saved activations alias their input, and one block object
applied at several depths.

A block under an outer residual (``h = h + block(h)``, the block a plain MLP) saves a view
of its input for its first weight's gradient. torch's Inductor does not know that a region's
output shares its operand's storage: it wrote the sum into ``h``'s buffer, and the backward
computed that weight's gradient from the sum (off by up to its own size; torch 2.11 to 2.14, also
without graphshard). ``rewire_region_passthrough`` reads such an output as a view of the
operand taken in the step graph, an alias Inductor sees.

A block whose last op saves its result for the backward (``Tanh``, ``Sigmoid``) returns that
result twice, as its output and as a saved tensor; Inductor took the two for separate buffers
and wrote the outer sum into the saved one (every gradient of the block and below wrong;
torch 2.11 to 2.14, also without graphshard). ``read_shared_region_outputs_once`` reads the
two as one output.
Numerics against the model run eagerly (one real gloo rank), with Inductor on.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import fx, nn

import graphshard
from graphshard.api.sharding import shard_state
from graphshard.passes.errors import GraphLoweringError
from graphshard.passes.fx_util import NodeMaker
from graphshard.passes.plan import Plan
from graphshard.passes.regions import (
    _operand_read,
    _view_chain,
    read_shared_region_outputs_once,
    region_body,
    region_calls,
)


def _mlp(last: type[nn.Module] | None = None) -> nn.Module:
    """A feed-forward block; ``last``: an activation after its second layer, whose backward
    reads its result (the block then returns that result twice: output and saved)."""
    layers = [nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)]
    return nn.Sequential(*layers, *([last()] if last is not None else []))


class _OuterResidual(nn.Module):
    """Blocks added to the stream outside them; ``shared``: one block object at every depth
    (a looped, ALBERT-style model), else three blocks of their own; ``last``: see
    :func:`_mlp`."""

    def __init__(self, shared: bool, last: type[nn.Module] | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        first = _mlp(last)
        self.layers = nn.ModuleList([first] * 3 if shared else
                                    [first, *(copy.deepcopy(first) for _ in range(2))])
        self.head = nn.Linear(16, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def _tokens(length: int = 12) -> torch.Tensor:
    return torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("last", [None, nn.Tanh, nn.Sigmoid],
                         ids=["linear last", "tanh last", "sigmoid last"])
@pytest.mark.parametrize("shared", [False, True], ids=["own blocks", "one block object"])
@pytest.mark.parametrize("mode", ["compiled", "eager"])
def test_blocks_under_an_outer_residual_train_like_the_eager_model(one_rank, shared, mode, last):
    torch.manual_seed(0)
    reference = _OuterResidual(shared, last)
    model = graphshard.shard(copy.deepcopy(reference))
    run = torch.compile(model, backend=graphshard.backend()) if mode == "compiled" else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(2):
        run(_tokens()).backward()
        reference(_tokens()).backward()
        for (name, want), got in zip(reference.named_parameters(), model.parameters(),
                                     strict=True):
            torch.testing.assert_close(got.grad.full_tensor(), want.grad, msg=name)
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()


class _CheckpointedResidual(_OuterResidual):
    """The same, each block under ``torch.utils.checkpoint`` (its region is then called
    inside the checkpoint's body)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


@pytest.mark.parametrize("model_class", [_OuterResidual, _CheckpointedResidual],
                         ids=["plain", "checkpointed"])
def test_dynamic_shapes_train_like_the_eager_model(one_rank, model_class):
    """Under dynamic shapes the saved view's sizes are computed in the region's body from
    its size operands (``[s0*s1, 16]``); the step graph computes them again to take the
    view there. Left as a region output, the first weight's gradient came out wrong.

    Checkpointed: Dynamo reuses the first block's traced region for the second; inside a
    checkpoint body it looked the region's size symbols up in that body's tracer, which had
    not bound them (``InternalTorchDynamoError: KeyError: s0``, plain
    ``nested_compile_region`` too). The block's call reads its operands' sizes first, which
    binds them."""
    torch.manual_seed(0)
    reference = model_class(shared=False)
    model = graphshard.shard(copy.deepcopy(reference))
    run = torch.compile(model, backend=graphshard.backend(), dynamic=True)
    for length in (12, 7):
        run(_tokens(length)).backward()
        reference(_tokens(length)).backward()
        for (name, want), got in zip(reference.named_parameters(), model.parameters(),
                                     strict=True):
            torch.testing.assert_close(got.grad.full_tensor(), want.grad, msg=name)
            got.grad = want.grad = None


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_the_step_reads_no_region_output_that_views_an_operand(fake2, dynamic):
    """After the joint passes, every region output read by the step is computed in its body,
    and no two of one call share storage there: an alias of an operand is taken in the step
    graph instead, and a value the body returns twice (the ``Tanh``'s result, output and
    saved) is read once."""
    model = graphshard.shard(_OuterResidual(shared=False, last=nn.Tanh))
    backend = graphshard.backend(inductor=False)
    torch.compile(model, backend=backend, dynamic=dynamic)(_tokens()).backward()
    (joint,) = [stages["joint"] for stages in backend.graphs if "joint" in stages]
    read = 0
    for call in region_calls(joint):
        outputs = region_body(call).graph.output_node().args[0]
        roots: dict[fx.Node, int] = {}
        for user in call.users:
            assert user.target is operator.getitem
            out = outputs[user.args[1]]
            assert isinstance(out, fx.Node) and out.op != "placeholder"
            read += 1
            source = out
            while source.op == "call_function" and source.target in (
                    torch.ops.aten.view.default, torch.ops.aten.permute.default,
                    torch.ops.aten._unsafe_view.default):
                source = source.args[0]
            assert source.op != "placeholder", f"{call.name} output {user.args[1]}: {out}"
            assert roots.setdefault(source, user.args[1]) == user.args[1], (
                f"{call.name} outputs {roots[source]} and {user.args[1]} share {source}")
    assert read > 0
    views = [n for n in joint.graph.nodes if n.target is torch.ops.aten.view.default
             and any(u.op == "call_function" and u in set(region_calls(joint)) for u in n.users)]
    assert views, "the saved input's view is taken in the step graph and passed to the backward"


def test_a_saved_view_the_step_cannot_take_is_refused_not_left_to_alias():
    """A region output that views an operand through a value the step graph cannot compute
    (here a tensor of the body) raises, naming the way out, instead of staying a region
    output that Inductor may overwrite."""
    body = fx.Graph()
    block_input = body.placeholder("block_input")
    total = body.call_function(torch.ops.aten.sum.default, (block_input,))
    total.meta["val"] = torch.empty(())
    saved = body.call_function(torch.ops.aten.view.default, (block_input, [total]))
    body.output((saved,))
    step = fx.Graph()
    operand = step.placeholder("h")
    call = step.call_function(torch.ops.aten.add.Tensor, (operand, operand))
    step.output(call)
    with pytest.raises(GraphLoweringError, match="compile_blocks_once=False"):
        _operand_read(NodeMaker(step), call, saved, {block_input: operand})


def test_one_block_object_at_several_depths_is_one_bucket(fake2):
    """The main list holding one block three times is bucketed by its distinct blocks: the
    block's parameters are gathered once a forward, not refused as in two buckets."""
    model = graphshard.shard(_OuterResidual(shared=True))
    assert shard_state(model).bucket_names == ["<before blocks>", "layers.0", "<after blocks>"]


def test_a_parameter_in_two_of_the_users_buckets_is_still_refused():
    model = _OuterResidual(shared=True)
    with pytest.raises(graphshard.GraphshardError, match="may belong to one bucket only"):
        graphshard.api.sharding._assign_buckets(model, [[model.layers[0]], [model.layers[1]]])


def _region_step(outputs_of: callable) -> tuple[fx.GraphModule, fx.GraphModule, fx.Node]:
    """A step graph calling a hand-built region body once and reading both its outputs
    (``outputs_of(body_graph, block_input)`` returns them), each read by its own op."""
    body = fx.Graph()
    block_input = body.placeholder("block_input")
    body.output(tuple(outputs_of(body, block_input)))
    root = torch.nn.Module()
    root.region = fx.GraphModule(torch.nn.Module(), body)
    step = fx.Graph()
    h = step.placeholder("h")
    region = step.get_attr("region")
    call = step.call_function(torch.ops.higher_order.invoke_subgraph, (region, "region", h))
    first = step.call_function(operator.getitem, (call, 0))
    second = step.call_function(operator.getitem, (call, 1))
    step.output((step.call_function(torch.ops.aten.add.Tensor, (h, first)),
                 step.call_function(torch.ops.aten.neg.default, (second,))))
    return fx.GraphModule(root, step), root.region, call


def test_a_value_the_region_returns_twice_is_read_once():
    """The body's result returned as output and as saved tensor: the step reads one getitem
    for both, so Inductor sees one buffer, live until the backward."""
    def outputs(body, x):
        result = body.call_function(torch.ops.aten.tanh.default, (x,))
        return result, result

    gm, _, call = _region_step(outputs)
    read_shared_region_outputs_once(gm, Plan())
    assert [user.args[1] for user in call.users] == [0]
    (read,) = call.users
    assert {user.target for user in read.users} == {torch.ops.aten.add.Tensor,
                                                   torch.ops.aten.neg.default}


def test_a_view_of_another_output_is_taken_in_the_step():
    def outputs(body, x):
        result = body.call_function(torch.ops.aten.tanh.default, (x,))
        return result, body.call_function(torch.ops.aten.view.default, (result, [-1]))

    gm, _, call = _region_step(outputs)
    read_shared_region_outputs_once(gm, Plan())
    (read,) = call.users
    (view,) = [user for user in read.users if user.target is torch.ops.aten.view.default]
    assert view.args == (read, [-1])
    assert [user.target for user in view.users] == [torch.ops.aten.neg.default]


def test_two_views_of_a_value_not_returned_become_a_copy():
    """Two outputs viewing one body value that is not itself returned cannot be read as one
    and views of it in the step: the body returns a copy for the second."""
    def outputs(body, x):
        result = body.call_function(torch.ops.aten.tanh.default, (x,))
        return (body.call_function(torch.ops.aten.view.default, (result, [-1])),
                body.call_function(torch.ops.aten.permute.default, (result, [1, 0])))

    gm, region, call = _region_step(outputs)
    read_shared_region_outputs_once(gm, Plan())
    first, second = region.graph.output_node().args[0]
    assert second.target is torch.ops.aten.clone.default
    assert _view_chain(second)[0] is second and _view_chain(first)[0] is not second
    assert sorted(user.args[1] for user in call.users) == [0, 1]
