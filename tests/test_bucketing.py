"""Bucketing strategies: size packing, the cost-model search, and pinned user groups."""

from __future__ import annotations

import pytest
import torch
from graph_utils import KeyedLayersLlama, c10d, calls, fake_process_group

import graphshard
from graphshard.api.sharding import shard_state
from graphshard.models.llama import Llama, llama_config
from graphshard.passes.bucketing import auto_boundaries, pack_by_size
from graphshard.passes.markers import is_unshard, marker_args


def test_pack_by_size():
    assert pack_by_size([4, 4, 4, 10, 1, 1], cap=8) == [0, 0, 1, 2, 3, 3]


def test_auto_keeps_exposed_ends_small_when_compute_hides_the_middle():
    # Exposed: the first bucket's gather (1 s) and the last one's backward gather (1 s);
    # every other gather hides under 10 s of compute, so the middle merges (fewer buckets).
    idx = auto_boundaries([1, 1, 1, 1], [10.0] * 4, gather_time=float, reduce_time=lambda b: 0.0)
    assert idx == [0, 1, 1, 2]


def test_auto_merges_when_nothing_can_hide():
    idx = auto_boundaries([1, 1, 1, 1], [0.0] * 4, gather_time=lambda b: 1.0 + b,
                          reduce_time=lambda b: 0.0)
    assert idx == [0, 0, 0, 0]


def test_auto_respects_memory_cap():
    idx = auto_boundaries([1, 1, 1, 1], [0.0] * 4, gather_time=lambda b: 1.0 + b,
                          reduce_time=lambda b: 0.0, cap=2)
    # any two neighbouring buckets together stay within 2 bytes: single-item buckets
    assert idx == [0, 1, 2, 3]


def joint_buckets(model, **options) -> dict[str, int]:
    """Parameter name -> bucket after the joint-graph passes of a compiled fw+bw step."""
    backend = graphshard.backend(inductor=False, **options)
    ids = torch.randint(0, 256, (2, 16))
    torch.compile(model, backend=backend)(ids).loss.backward()
    (stages,) = backend.graphs
    markers = [n for n in stages["joint"].graph.nodes if is_unshard(n)]
    return {marker_args(n).name: marker_args(n).bucket for n in markers}


@pytest.fixture
def world2():
    with fake_process_group(2):
        torch.manual_seed(0)
        yield


def llama():
    return Llama(llama_config("tiny", tie_embeddings=False))


def test_block_default_gathers_the_embedding_apart_from_norm_and_output(world2):
    """The default buckets: the embedding (registered before the blocks) in one, the final
    norm and output head (after them) in another, each block in its own."""
    model = graphshard.shard(llama())
    assert shard_state(model).bucket_names == [
        "<before blocks>", "layers.0", "layers.1", "<after blocks>"]
    buckets = joint_buckets(model)
    assert buckets["tok_embeddings.weight"] != buckets["output.weight"] == buckets["norm.weight"]
    assert buckets["layers.0.attention.wq.weight"] not in (
        buckets["tok_embeddings.weight"], buckets["output.weight"])


def test_a_tied_embedding_stays_with_the_embedding(world2):
    """Tied input and output embeddings are one parameter, first registered (and first
    read) as the embedding: it is gathered with it, the norm after the blocks alone."""
    model = graphshard.shard(Llama(llama_config("tiny", tie_embeddings=True)))
    state = shard_state(model)
    bucket = {name: entry.bucket for entry in state.params for name in entry.names}
    assert bucket["tok_embeddings.weight"] == bucket["output.weight"] == 0
    assert state.bucket_names[bucket["norm.weight"]] == "<after blocks>"


def test_the_rest_on_one_side_of_the_blocks_stays_one_bucket(world2):
    """A model whose other parameters all come after its blocks (or whose buckets the user
    names) keeps one last bucket for them."""
    head_only = torch.nn.Module()
    head_only.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
    head_only.head = torch.nn.Linear(8, 2)
    assert shard_state(graphshard.shard(head_only)).bucket_names == [
        "blocks.0", "blocks.1", "<rest>"]
    model = llama()
    named = graphshard.shard(model, buckets=list(model.layers))
    assert shard_state(named).bucket_names == ["layers.0", "layers.1", "<rest>"]


def test_auto_separates_embedding_from_norm_and_output(world2):
    buckets = joint_buckets(graphshard.shard(llama()), bucketing="auto")
    assert buckets["tok_embeddings.weight"] != buckets["output.weight"]
    assert buckets["tok_embeddings.weight"] != buckets["norm.weight"]


def test_size_buckets_follow_execution_order_within_cap(world2):
    model = graphshard.shard(llama())
    cap = 40_000
    backend = graphshard.backend(inductor=False, bucketing="size", bucket_bytes=cap)
    torch.compile(model, backend=backend)(torch.randint(0, 256, (2, 16))).loss.backward()
    (stages,) = backend.graphs
    markers = [n for n in stages["joint"].graph.nodes if is_unshard(n)]
    order = [marker_args(n).bucket for n in markers]
    assert order == sorted(order), "buckets are consecutive in execution order"
    gathers = calls(stages["fw"], c10d.all_gather_into_tensor.default)
    assert len(gathers) == len(set(order))
    for gather in gathers:
        full = gather.meta["val"]
        bucket = gather.meta["graphshard"]["bucket"]
        params = [n for n in markers if marker_args(n).bucket == bucket]
        assert full.nbytes <= cap or len(params) == 1


def test_user_groups_survive_every_strategy(world2):
    model = llama()
    graphshard.shard(model, buckets=[[model.tok_embeddings, model.norm]])
    buckets = joint_buckets(model, bucketing="size", bucket_bytes=1)
    assert buckets["tok_embeddings.weight"] == buckets["norm.weight"] == 0
    pinned = ("tok_embeddings.weight", "norm.weight")
    others = {b for name, b in buckets.items() if name not in pinned}
    assert 0 not in others and len(others) > 1


class _MixedDtypes(torch.nn.Module):
    """A bf16 projection and an fp32 norm in one module: one bucket by module, two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 6, dtype=torch.bfloat16)
        self.norm = torch.nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(self.proj(x.bfloat16()).float())


def test_a_bucket_holds_one_dtype_and_each_parameter_keeps_its_own(world2):
    """Before, the bf16 weight and the fp32 norm shared a bucket, whose flat buffer promoted
    the weight to fp32 and the forward failed on a dtype mismatch. shard() splits a group by
    dtype; the lowered forward gathers each dtype on its own, in its own dtype."""
    model = graphshard.shard(_MixedDtypes())
    state = graphshard.api.sharding.shard_state(model)
    assert state.bucket_names == ["<rest>[bfloat16]", "<rest>[float32]"]
    assert {p.names[0]: p.bucket for p in state.params} == {
        "proj.weight": 0, "proj.bias": 0, "norm.weight": 1, "norm.bias": 1}
    backend = graphshard.backend(inductor=False)
    out = torch.compile(model, backend=backend)(torch.randn(3, 8))
    assert out.dtype == torch.float32
    out.sum().backward()
    (stages,) = backend.graphs
    gathers = calls(stages["fw"], c10d.all_gather_into_tensor.default)
    assert sorted(str(g.meta["val"].dtype) for g in gathers) == ["torch.bfloat16",
                                                                 "torch.float32"]
    grads = {n: p.grad.dtype for n, p in model.named_parameters()}
    assert grads == {"proj.weight": torch.bfloat16, "proj.bias": torch.bfloat16,
                     "norm.weight": torch.float32, "norm.bias": torch.float32}


def test_blocks_kept_in_a_module_dict_are_the_default_buckets_too(world2):
    """torchtitan keeps its blocks in an ``nn.ModuleDict``: each is a bucket, as a
    ``ModuleList``'s are (the whole model was one bucket before, and nothing said so)."""
    model = graphshard.shard(KeyedLayersLlama(llama()))
    assert shard_state(model).bucket_names == [
        "<before blocks>", "layers.0", "layers.1", "<after blocks>"]
    model = KeyedLayersLlama(llama())  # named by hand: the dict's modules, one group each
    named = graphshard.shard(model, buckets=model.layers)
    assert shard_state(named).bucket_names == ["layers.0", "layers.1", "<rest>"]


def test_a_module_dict_of_unlike_parts_is_not_taken_for_blocks(world2):
    """Two towers in a ModuleDict are not a list of blocks: the blocks inside them are."""
    from graph_utils import BlockStack

    model = torch.nn.Module()
    model.towers = torch.nn.ModuleDict({"a": BlockStack(3), "b": torch.nn.Linear(8, 8)})
    assert shard_state(graphshard.shard(model)).bucket_names == [
        "towers.a.blocks.0", "towers.a.blocks.1", "towers.a.blocks.2", "<rest>"]


def test_an_encoders_layers_are_buckets_beside_the_decoders(world2):
    """torch's ``nn.Transformer``: the encoder's layers are blocks as the decoder's are (the
    encoder was one bucket, gathered whole before its first layer). Beside the main list,
    only a list of like blocks counts: a ``Sequential`` head of unlike layers stays whole."""
    model = graphshard.shard(torch.nn.Transformer(
        d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=32))
    assert shard_state(model).bucket_names == [
        "encoder.layers.0", "encoder.layers.1",
        "decoder.layers.0", "decoder.layers.1", "decoder.layers.2", "<rest>"]
    with_head = torch.nn.Module()
    with_head.blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
    with_head.head = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(),
                                         torch.nn.Linear(4, 2))
    assert shard_state(graphshard.shard(with_head)).bucket_names == [
        "blocks.0", "blocks.1", "blocks.2", "<rest>"]
