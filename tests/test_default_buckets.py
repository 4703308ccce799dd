"""The default buckets around the blocks: the embedding's apart from the final norm and output
head's, so the head's gather runs under the blocks' forward and its reduce-scatter under
their backward, where one bucket for both gathered the head before any compute and sent its
gradient after the embedding's, the last of the backward. Checked on the compiled step in a
fake world of 2 (collectives that move real data, in this process): the graph's order, and
the values against the same model with one bucket for both."""

from __future__ import annotations

import pytest
import torch
from graph_utils import in_fake_world
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

import graphshard
from graphshard.api.sharding import shard_state
from graphshard.models.llama import Llama, llama_config
from graphshard.passes.fx_util import aten, c10d

CFG = llama_config("tiny", vocab_size=1024, tie_embeddings=False)  # embedding, head: 256 KiB


@pytest.fixture
def world2():
    with in_fake_world(2):
        yield


def _model(one_rest_bucket: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Llama(CFG)
    if one_rest_bucket:  # named groups keep one bucket for everything else, as before
        return graphshard.shard(model, buckets=list(model.layers))
    return graphshard.shard(model)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 16),
                         generator=torch.Generator().manual_seed(step))


def _bucket_of(model, name: str) -> int:
    return next(e.bucket for e in shard_state(model).params if name in e.names)


def _compute_between(graph, first, last) -> int:
    """Matrix products and block calls (compile regions) strictly between nodes ``first`` and
    ``last`` of ``graph``."""
    nodes = list(graph.nodes)
    span = nodes[nodes.index(first) + 1:nodes.index(last)]
    return sum(n.target is aten.mm.default or n.target is invoke_subgraph for n in span)


def test_the_head_is_gathered_under_the_blocks_and_reduced_under_their_backward(world2):
    """Forward: the first gather holds the embedding only, and the head's gather is issued
    before the last block's compute, not waited for until after it. Backward: the head's
    reduce-scatter is issued before the blocks' matrix products run."""
    model = _model(one_rest_bucket=False)
    backend = graphshard.backend(inductor=False)
    torch.compile(model, backend=backend)(_tokens(0)).loss.backward()
    (stages,) = backend.graphs
    head = _bucket_of(model, "output.weight")
    assert head != _bucket_of(model, "tok_embeddings.weight")

    fw = stages["fw"].graph
    gathers = [n for n in fw.nodes if n.target is c10d.all_gather_into_tensor.default]
    assert gathers[0].meta["graphshard"]["params"] == ["tok_embeddings.weight"]
    (head_gather,) = [g for g in gathers if g.meta["graphshard"]["bucket"] == head]
    (head_wait,) = head_gather.users
    assert _compute_between(fw, head_gather, head_wait) > 0

    bw = stages["bw"].graph
    reduces = [n for n in bw.nodes if n.target is c10d.reduce_scatter_tensor.default]
    (head_reduce,) = [r for r in reduces if r.meta["graphshard"]["bucket"] == head]
    assert _compute_between(bw, head_reduce, list(bw.nodes)[-1]) > 0
    assert reduces[-1].meta["graphshard"]["params"] == ["tok_embeddings.weight"]


def _step(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One compiled step's loss and the gradients' local shards."""
    compiled = torch.compile(model, backend=graphshard.backend(inductor=False))
    loss = compiled(_tokens(1)).loss
    loss.backward()
    return loss.detach(), [p.grad.to_local() for p in model.parameters()]


def test_the_split_changes_no_value(world2):
    """The same loss and gradient shards, bit for bit, as with one bucket for the embedding
    and the head: the buckets change when bytes move, not what is summed."""
    split_loss, split_grads = _step(_model(one_rest_bucket=False))
    torch._dynamo.reset()
    one_loss, one_grads = _step(_model(one_rest_bucket=True))
    assert torch.equal(split_loss, one_loss)
    assert all(map(torch.equal, split_grads, one_grads))
