"""``graphshard.api.grad_norm_ops``: ``clip_grad_norm_`` on sharded gradients takes the
per-gradient norms on the local tensors, with DTensor's own result bit for bit, and whatever
that path cannot serve still goes through DTensor's dispatch."""

from __future__ import annotations

import pytest
import torch
from graph_utils import sharded_with_grads
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from graphshard.api import grad_norm_ops
from graphshard.models.llama import Llama, llama_config
from graphshard.models.mlp import OddMLP

aten = torch.ops.aten
HANDLERS = DTensor._op_dispatcher._custom_op_handlers


@pytest.fixture
def served(monkeypatch):
    """How many norms the local path wrapped (calls served from the remembered specs)."""
    seen = []
    wrap = grad_norm_ops.wrap_local
    monkeypatch.setattr(grad_norm_ops, "wrap_local",
                        lambda local, spec: seen.append(spec) or wrap(local, spec))
    return seen


def _clip(model: torch.nn.Module, norm_type: float) -> tuple[torch.Tensor, list]:
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=norm_type)
    return total, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("build", [OddMLP, lambda: Llama(llama_config("tiny"))],
                         ids=["odd-mlp", "llama"])
def test_a_clip_of_sharded_gradients_takes_the_local_norms_with_dtensors_result(
        fake2, served, build, norm_type):
    """Three clips (uneven shards in the odd MLP; the threshold low enough to scale) give,
    bit for bit, the total norm and gradients of the same clips through DTensor's dispatch,
    and the norms carry DTensor's placements; from the second clip on, the norms are served
    locally."""
    model, reference = sharded_with_grads(build), sharded_with_grads(build)
    count = len(list(model.parameters()))
    for step in range(3):
        total, grads = _clip(model, norm_type)
        with grad_norm_ops.dtensor_dispatch():
            expected, expected_grads = _clip(reference, norm_type)
        assert len(served) == count * step  # the first clip went through DTensor
        assert torch.equal(total.full_tensor(), expected.full_tensor())
        assert total.placements == expected.placements
        for mine, theirs in zip(grads, expected_grads, strict=True):
            assert torch.equal(mine.to_local(), theirs.to_local())
            assert mine.placements == theirs.placements
    grads = [p.grad for p in model.parameters()]
    norms = torch._foreach_norm(grads, norm_type)
    with grad_norm_ops.dtensor_dispatch():
        theirs = torch._foreach_norm(grads, norm_type)
    for mine, ref in zip(norms, theirs, strict=True):
        assert mine._spec == ref._spec and torch.equal(mine.to_local(), ref.to_local())
    assert HANDLERS[aten._foreach_norm.Scalar] is grad_norm_ops._norms


def test_hsdp_gradients_are_served_with_their_replicated_dimension(fake2, served):
    """On a 2-D (replicate, shard) mesh the norms are replicated on the first dimension and
    partial on the second, as DTensor makes them."""
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    model, reference = sharded_with_grads(OddMLP, mesh), sharded_with_grads(OddMLP, mesh)
    for _ in range(2):
        total, _ = _clip(model, 2.0)
        with grad_norm_ops.dtensor_dispatch():
            expected, _ = _clip(reference, 2.0)
        assert torch.equal(total.full_tensor(), expected.full_tensor())
    assert served and all(spec.placements[0] == Replicate() and spec.placements[1].is_partial()
                          for spec in served)


def test_other_dtensors_and_partial_ones_keep_dtensors_dispatch(fake2, served):
    """DTensors on a mesh no sharded model uses (another library's, as FSDP2 makes them) and
    a partial gradient are never served locally, however often they are clipped; their
    result is DTensor's."""
    sharded_with_grads(OddMLP)  # installs the handler
    mesh = init_device_mesh("cpu", (2,))
    theirs = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
    theirs.grad = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    for _ in range(2):
        torch.nn.utils.clip_grad_norm_([theirs], 1.0)
    model = sharded_with_grads(OddMLP)
    first = next(model.parameters())  # a partial sum on a sharded model's mesh
    partial = DTensor.from_local(torch.randn(first.shape), first.device_mesh, [Partial()])
    for _ in range(2):
        norms = torch._foreach_norm([partial], 2.0)
    with grad_norm_ops.dtensor_dispatch():
        expected = torch._foreach_norm([partial], 2.0)
    assert served == []
    assert norms[0].placements == expected[0].placements
    assert torch.equal(norms[0].to_local(), expected[0].to_local())


def test_a_gradient_on_a_new_spec_is_checked_again(fake2, served):
    """A gradient replaced by one on another spec (replicated here) makes a list of specs
    not seen before: DTensor's dispatch answers it first, then the local path serves it with
    the replicated norm DTensor gives."""
    model = sharded_with_grads(OddMLP)
    _clip(model, 2.0)
    first = next(model.parameters())
    first.grad = first.grad.redistribute(first.device_mesh, [Replicate()])
    grads = [p.grad for p in model.parameters()]
    torch._foreach_norm(grads, 2.0)
    assert served == []  # the new list went through DTensor's dispatch
    norms = torch._foreach_norm(grads, 2.0)
    assert len(served) == len(grads)
    assert norms[0].placements == (Replicate(),)
    assert all(n.placements[0].is_partial() for n in norms[1:])


def test_shard_while_a_dead_models_finalizers_run_inside_it(fake2, monkeypatch):
    """A collection may start at any allocation, including the one that makes a finalizer
    inside ``shard()``, and then runs the finalizers of sharded models that are garbage.
    Those must not wait for a lock ``shard()`` holds there: until 2026-12-03 one did, and a
    rank of a test launch hung in ``shard()`` (a barrier timeout on the others). Here, at
    every finalizer ``shard()`` makes, another sharded model dies in a reference cycle and a
    collection frees it."""
    import gc
    import threading
    import weakref

    doomed = []
    for _ in range(8):
        model = sharded_with_grads(OddMLP)
        model.itself = model  # a cycle: refcounting alone never frees it
        doomed.append(model)
    freed = [weakref.ref(model) for model in doomed]
    del model
    real_finalize = weakref.finalize

    def finalize_as_another_model_dies(*args, **kwargs):
        if doomed:
            doomed.pop()
        gc.collect()  # what the allocation of the finalizer may start
        return real_finalize(*args, **kwargs)

    monkeypatch.setattr(weakref, "finalize", finalize_as_another_model_dies)
    gc.disable()  # nothing else collects the cycles
    try:
        done = []
        worker = threading.Thread(target=lambda: done.append(sharded_with_grads(OddMLP)),
                                  daemon=True)
        worker.start()
        worker.join(timeout=60)
    finally:
        gc.enable()
    assert not worker.is_alive(), "shard() hung in a dead model's finalizer"
    assert done and sum(ref() is None for ref in freed) >= 2  # models died inside shard()
    grads = [p.grad for p in done[0].parameters()]
    for _ in range(2):  # the live model's norms: the second call served locally
        total = torch.nn.utils.get_total_norm(grads)
    with grad_norm_ops.dtensor_dispatch():
        expected = torch.nn.utils.get_total_norm(grads)
    assert torch.equal(total.full_tensor(), expected.full_tensor())
