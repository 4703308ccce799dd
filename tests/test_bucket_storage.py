"""Each bucket's shards in one flat, padded buffer (``graphshard.api.bucket_storage``), and
flat gathers that read it instead of copying the shards in (``graphshard.passes.
bucket_storage``): the layout, the graphs, the traffic, training against the copied-in path,
the layout kept through new storage and dropped where a bucket stops qualifying, and the
state-dict idioms DTensor breaks on at a nonzero storage offset."""

from __future__ import annotations

import copy

import pytest
import torch
from graph_utils import in_fake_world
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import graphshard
from graphshard.api.sharding import shard_state
from graphshard.models.llama import Llama, llama_config
from graphshard.passes.fx_util import aten, c10d
from graphshard.passes.layout import Dim0Layout
from graphshard.passes.traffic import step_traffic

CFG = llama_config("tiny")


@pytest.fixture
def world2():
    with in_fake_world(2):
        yield


# (world, rank): rank 0 of 2, whose shards fill their pieces, and the last rank of 3, whose
# shards of llama tiny's 64- and 176-row weights are 20 and 56 rows of 22- and 59-row pieces
UNEVEN = pytest.mark.parametrize("world_rank", [(2, 0), (3, 2)], ids=["2-rank0", "3-rank2"])


def _model(seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(CFG)


def _buckets(model) -> dict[int, list]:
    out: dict[int, list] = {}
    for entry in shard_state(model).params:
        out.setdefault(entry.bucket, []).append(entry)
    return out


def _laid_out(entries) -> bool:
    """Whether the records' local tensors live in their bucket's buffer, piece after piece
    from its start, each at offset 0 of a storage of its own (what DTensor needs for
    ``copy.deepcopy`` and ``torch.save``)."""
    group = entries[0].storage_group
    if group is None or group.flat is None or group.entries != entries:
        return False
    flat, offset = group.flat, 0
    for e in entries:
        t = e.param._local_tensor
        if (t.data_ptr() != flat.data_ptr() + offset * flat.element_size()
                or t.storage_offset() != 0
                or t.untyped_storage().nbytes() != t.numel() * t.element_size()):
            return False
        offset += Dim0Layout(e.full_shape, e.param.device_mesh.size(-1)).piece_numel
    return offset == flat.numel()


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, CFG.vocab_size, (2, 16), generator=g)


def _train(model, run, steps: int = 3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = run(_batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@UNEVEN
def test_shard_lays_each_bucket_out_in_one_zero_padded_buffer(world_rank):
    """Every bucket's shards are views of one buffer, piece after piece, with the rows the
    rank holds and zeros in the padding; the values are the rank's rows of the model."""
    world, rank = world_rank
    with in_fake_world(world, rank):
        model = _model()
        full = {name: p.detach().clone() for name, p in model.named_parameters()}
        graphshard.shard(model)
        buckets = _buckets(model)
        assert len(buckets) > 1
        padded = 0
        for entries in buckets.values():
            assert _laid_out(entries), [e.names for e in entries]
            flat = entries[0].storage_group.flat
            offset = 0
            for e in entries:
                layout = Dim0Layout(e.full_shape, world)
                piece = flat[offset:offset + layout.piece_numel].view(layout.piece_shape)
                rows = layout.local(full[e.names[0]], rank)
                torch.testing.assert_close(piece[:rows.shape[0]], rows, rtol=0, atol=0)
                assert not piece[rows.shape[0]:].any()
                padded += layout.piece_numel - rows.numel()
                offset += layout.piece_numel
        assert (padded > 0) == (world == 3)


def _forward_gathers(gm) -> list:
    return [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]


def _reads_an_input(gather) -> bool:
    """Whether ``gather`` sends a graph input as it is: its bucket's buffer, or the flat view
    of a bucket's lone shard that fills its piece (the embedding's bucket), neither copied."""
    source = gather.args[0]
    if source.target is aten.view.default:
        source = source.args[0]
    return source.op == "placeholder" and gather.args[0].meta["val"].dim() == 1


def test_a_flat_gather_reads_the_storage_and_copies_nothing_in(world2):
    """The forward's gathers read each bucket's buffer, a graph input the reads hand to the
    markers, with no concatenation; the copy-in traffic is zero. With
    ``gather_from_storage=False`` the same model concatenates its shards at every gather."""
    traffic, cats = {}, {}
    for from_storage in (True, False):
        backend = graphshard.backend(inductor=False, gather_from_storage=from_storage)
        model = graphshard.shard(_model())
        compiled = torch.compile(model, backend=backend)
        compiled(_batch(0)).loss.backward()
        (stages,) = backend.graphs
        fw = stages["fw"]
        gathers = _forward_gathers(fw)
        assert gathers
        if from_storage:
            assert all(map(_reads_an_input, gathers)), [g.args[0].format_node() for g in gathers]
        cats[from_storage] = sum(n.target is aten.cat.default for n in fw.graph.nodes)
        traffic[from_storage] = step_traffic(backend.graphs)
        torch._dynamo.reset()
    assert cats[True] == 0 < cats[False]
    assert traffic[True].moved["copy_in"] == 0 < traffic[False].moved["copy_in"]
    assert traffic[True].moved["interleave"] == traffic[False].moved["interleave"]


@pytest.mark.parametrize("param_dtype,from_storage", [(torch.float32, True),
                                                     (torch.bfloat16, False)],
                         ids=["fp32-params", "bf16-params"])
def test_mixed_precision_gathers_the_storage_only_without_a_cast(world2, param_dtype,
                                                                  from_storage):
    """Gathering fp32 parameters as fp32 (a bf16 reduction only) reads the storage; gathering
    them as bf16 casts, which writes the gather buffer anyway, so the shards are cast in."""
    policy = graphshard.MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.bfloat16)
    backend = graphshard.backend(inductor=False)
    model = graphshard.shard(_model(), mixed_precision=policy)
    torch.compile(model, backend=backend)(_batch(0)).loss.backward()
    gathers = _forward_gathers(backend.graphs[0]["fw"])
    assert gathers
    assert [_reads_an_input(g) for g in gathers] == [from_storage] * len(gathers)


@UNEVEN
def test_training_from_the_storage_matches_the_copied_in_path(world_rank):
    """Three AdamW steps compiled with Inductor, gathering from the storage and copying in:
    the same losses and parameters (the gathered values are the same bytes), and the eager
    model's losses. On the last rank of 3 the gathers send each piece's padding as it lies
    in the storage."""
    with in_fake_world(*world_rank):
        _compare_training()


def _compare_training() -> None:
    runs = []
    for options in ({}, {"gather_from_storage": False}):
        model = graphshard.shard(_model())
        compiled = torch.compile(model, backend=graphshard.backend(**options))
        runs.append((_train(model, compiled), model))
        torch._dynamo.reset()
    eager = graphshard.shard(_model())
    eager_losses = _train(eager, eager)
    (stored, model), (copied, reference) = runs
    assert stored == copied
    torch.testing.assert_close(stored, eager_losses, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.to_local(), q.to_local(), rtol=0, atol=0, msg=name)
    assert all(_laid_out(entries) for entries in _buckets(model).values())


def test_to_empty_then_a_trace_lays_the_buckets_out_again(world2):
    """FSDP2's meta recipe: shard on the meta device, ``to_empty``, load. Each parameter then
    has storage of its own; the first trace lays every bucket out again, and training matches
    a model sharded with its values."""
    with torch.device("meta"):
        model = Llama(CFG)
    graphshard.shard(model, init_device_mesh("cpu", (2,)))  # a CUDA build would pick cuda
    model.to_empty(device="cpu")
    reference = graphshard.shard(_model())
    model.load_state_dict(reference.state_dict())
    assert not any(_laid_out(entries) for entries in _buckets(model).values())
    compiled = torch.compile(model, backend=graphshard.backend())
    compiled_ref = torch.compile(reference, backend=graphshard.backend())
    losses = _train(model, compiled)
    assert all(_laid_out(entries) for entries in _buckets(model).values())
    torch.testing.assert_close(losses, _train(reference, compiled_ref), rtol=1e-6, atol=1e-6)


def test_a_parameter_frozen_after_a_step_has_its_bucket_copied_in(world2):
    """A frozen parameter is read through its DTensor, which hands no buffer over: after
    freezing one, the next trace copies its bucket into the gather buffer (the others still
    gather their storage), training goes on as in the eager model and the frozen weight
    stays as it was. Without Inductor: the copy is the passes' (Inductor's reads of the
    storage have the test above)."""
    model = graphshard.shard(_model())
    eager = graphshard.shard(_model())
    backend = graphshard.backend(inductor=False)
    compiled = torch.compile(model, backend=backend)
    first = [_train(model, compiled, steps=1)[0], _train(eager, eager, steps=1)[0]]
    torch.testing.assert_close(first[0], first[1], rtol=1e-5, atol=1e-5)
    for m in (model, eager):
        m.layers[0].attention.wk.weight.requires_grad_(False)
    frozen = model.layers[0].attention.wk.weight.to_local().clone()
    after = _train(model, compiled, steps=2)
    torch.testing.assert_close(after, _train(eager, eager, steps=2), rtol=1e-5, atol=1e-5)
    weight = model.layers[0].attention.wk.weight
    assert isinstance(weight, DTensor)
    torch.testing.assert_close(weight.to_local(), frozen, rtol=0, atol=0)
    fw = backend.graphs[-1]["fw"]
    copied = [g.meta["graphshard"]["params"] for g in _forward_gathers(fw)
              if not _reads_an_input(g)]
    assert len(copied) == 1 and "layers.0.attention.wk.weight" in copied[0], copied


def test_state_dicts_deepcopy_and_save_with_the_buckets_laid_out(world2, tmp_path):
    """``copy.deepcopy`` and ``torch.save`` of a sharded state dict, which torch's DTensor
    fails for a local tensor at a nonzero storage offset: each local tensor is its own
    storage at offset 0, so both work, the copy is independent and the file holds each
    shard's bytes, not its bucket's."""
    model = graphshard.shard(_model())
    assert all(_laid_out(entries) for entries in _buckets(model).values())
    state = get_model_state_dict(model)
    twin = copy.deepcopy(state)
    for name, value in state.items():
        torch.testing.assert_close(twin[name].to_local(), value.to_local(), rtol=0, atol=0)
    with torch.no_grad():
        next(iter(twin.values())).to_local().add_(1)
    torch.testing.assert_close(next(iter(twin.values())).to_local(),
                               next(iter(state.values())).to_local() + 1)
    path = tmp_path / "rank0.pt"
    torch.save(state, path)
    loaded = torch.load(path, weights_only=False)
    shard_bytes = sum(v.to_local().numel() * v.to_local().element_size()
                      for v in state.values())
    assert path.stat().st_size < shard_bytes + 64 * 1024
    for name, value in state.items():
        torch.testing.assert_close(loaded[name].to_local(), value.to_local(), rtol=0, atol=0)


def _new_values_after_a_step(how: str):
    """A compiled model and its eager twin trained a step, then given new values for every
    parameter ``how``: ``"assign"`` (``load_state_dict(assign=True)`` of fresh tensors) or
    ``"to"`` (``.to(torch.float64)``, ``.to(torch.float32)``, then changed in place). The
    compiled graphs were traced on the bucket's buffers before."""
    model, eager = graphshard.shard(_model()), graphshard.shard(_model())
    backend = graphshard.backend()
    compiled = torch.compile(model, backend=backend)
    torch.testing.assert_close(_train(model, compiled, steps=1), _train(eager, eager, steps=1),
                               rtol=1e-5, atol=1e-5)
    torch.manual_seed(1)
    fresh = graphshard.shard(Llama(CFG)).state_dict()
    for m in (model, eager):
        if how == "assign":
            m.load_state_dict({k: v.clone() for k, v in fresh.items()}, assign=True)
        else:
            m.to(torch.float64)
            m.to(torch.float32)
            m.load_state_dict(fresh)
    return model, eager, compiled, backend


def test_new_values_by_assignment_go_to_the_buffer_the_graphs_read(world2):
    """``load_state_dict(assign=True)`` after a compiled step: each new local tensor of the
    same dtype goes into its piece of the bucket's buffer, which is its local tensor again.
    The graphs traced before run on the new values (no retrace) and match the eager model."""
    model, eager, compiled, backend = _new_values_after_a_step("assign")
    traced = len(backend.graphs)
    torch.testing.assert_close(_train(model, compiled, steps=2), _train(eager, eager, steps=2),
                               rtol=1e-5, atol=1e-5)
    assert len(backend.graphs) == traced
    assert all(_laid_out(entries) for entries in _buckets(model).values())


def test_a_new_dtype_drops_the_buffer_and_the_next_trace_lays_it_out(world2):
    """``.to(torch.float64)`` after a compiled step cannot go into the fp32 buffer: it is
    dropped, which fails the old graphs' guards. Back in fp32 with new values, the retrace
    lays every bucket out again, and training matches the eager model."""
    model, eager, compiled, backend = _new_values_after_a_step("to")
    assert not any(_laid_out(entries) for entries in _buckets(model).values())
    traced = len(backend.graphs)
    torch.testing.assert_close(_train(model, compiled, steps=2), _train(eager, eager, steps=2),
                               rtol=1e-5, atol=1e-5)
    assert len(backend.graphs) > traced
    assert all(_laid_out(entries) for entries in _buckets(model).values())
