"""``graphshard.clip_grad_norm_``: torch's ``clip_grad_norm_`` result, bit for bit, on sharded
gradients through the local path, and torch's own call wherever that path does not apply."""

from __future__ import annotations

import math

import pytest
import torch
from graph_utils import sharded_with_grads
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

import graphshard
from graphshard.api import clip_grad, grad_norm_ops
from graphshard.models.llama import Llama, llama_config
from graphshard.models.mlp import OddMLP


@pytest.fixture
def local_path(monkeypatch):
    """Whether each call took the local path (a layout) or went to torch's (None)."""
    seen: list[bool] = []
    layout = clip_grad._local_layout

    def spying(*args):
        out = layout(*args)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(clip_grad, "_local_layout", spying)
    return seen


def _same(mine: torch.nn.Module, total: torch.Tensor, theirs: torch.nn.Module,
          expected: torch.Tensor) -> None:
    assert type(total) is type(expected)
    if isinstance(total, DTensor):
        assert total.placements == expected.placements
        total, expected = total.to_local(), expected.to_local()
    assert torch.equal(total, expected) or (total.isnan().all() and expected.isnan().all())
    for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
        a, b = p.grad, q.grad
        if a is None or b is None:
            assert a is b
            continue
        if isinstance(a, DTensor):
            assert a.placements == b.placements
            a, b = a.to_local(), b.to_local()
        assert torch.equal(a, b) or (a.isnan().all() and b.isnan().all())


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e9], ids=["clips", "keeps"])
@pytest.mark.parametrize("build", [OddMLP, lambda: Llama(llama_config("tiny"))],
                         ids=["odd-mlp", "llama"])
def test_the_local_path_gives_torchs_clip_bit_for_bit(fake2, local_path, build, max_norm,
                                                      norm_type):
    """Twice in a row (the placements asked of DTensor once), against torch's call on the
    same gradients, with graphshard's norms and through DTensor's own dispatch."""
    mine, theirs, pure = (sharded_with_grads(build) for _ in range(3))
    for _ in range(2):
        total = graphshard.clip_grad_norm_(mine.parameters(), max_norm, norm_type)
        expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type)
        with grad_norm_ops.dtensor_dispatch():
            reference = torch.nn.utils.clip_grad_norm_(pure.parameters(), max_norm, norm_type)
        _same(mine, total, theirs, expected)
        _same(mine, total, pure, reference)
    assert local_path == [True, True]


def test_hsdp_gradients_take_the_local_path(fake2, local_path):
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    mine, theirs = sharded_with_grads(OddMLP, mesh), sharded_with_grads(OddMLP, mesh)
    total = graphshard.clip_grad_norm_(mine.parameters(), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    _same(mine, total, theirs, expected)
    assert local_path == [True] and total.placements == (Replicate(), Replicate())


def test_what_the_local_path_does_not_serve_is_torchs_own_call(fake2, local_path):
    """Plain parameters, ``foreach=False`` (torch's norms one by one) and gradients of two
    placements go to ``torch.nn.utils.clip_grad_norm_``, with its result."""
    torch.manual_seed(0)
    plain, plain_ref = OddMLP(), OddMLP()
    plain_ref.load_state_dict(plain.state_dict())
    for model in (plain, plain_ref):
        for p in model.parameters():
            p.grad = p.detach() * 3
    _same(plain, graphshard.clip_grad_norm_(plain.parameters(), 0.5),
          plain_ref, torch.nn.utils.clip_grad_norm_(plain_ref.parameters(), 0.5))

    mine, theirs = sharded_with_grads(OddMLP), sharded_with_grads(OddMLP)
    _same(mine, graphshard.clip_grad_norm_(mine.parameters(), 0.5, foreach=False),
          theirs, torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, foreach=False))

    mine, theirs = sharded_with_grads(OddMLP), sharded_with_grads(OddMLP)
    for model in (mine, theirs):
        first = next(model.parameters())
        first.grad = first.grad.redistribute(first.device_mesh, [Replicate()])
    _same(mine, graphshard.clip_grad_norm_(mine.parameters(), 0.5),
          theirs, torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5))
    assert local_path == [False, False, False]


def test_a_non_finite_norm_raises_when_asked_and_scales_like_torch_otherwise(fake2, local_path):
    mine, theirs = sharded_with_grads(OddMLP), sharded_with_grads(OddMLP)
    for model in (mine, theirs):
        next(model.parameters()).grad.to_local()[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="not finite.*error_if_nonfinite=False"):
        graphshard.clip_grad_norm_(mine.parameters(), 0.5, error_if_nonfinite=True)
    total = graphshard.clip_grad_norm_(mine.parameters(), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5)
    assert total.to_local().isnan() and expected.to_local().isnan()
    _same(mine, total, theirs, expected)
    assert local_path == [True, True]


def test_parameters_without_gradients_and_a_single_tensor(fake2, local_path):
    """Frozen parameters (no ``.grad``) are left out, as torch leaves them; one tensor is
    taken as a list of one."""
    mine, theirs = sharded_with_grads(OddMLP), sharded_with_grads(OddMLP)
    for model in (mine, theirs):
        next(model.parameters()).grad = None
    _same(mine, graphshard.clip_grad_norm_(mine.parameters(), 0.5),
          theirs, torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5))
    one, other = next((p, q) for p, q in zip(mine.parameters(), theirs.parameters(), strict=True)
                      if p.grad is not None)
    total = graphshard.clip_grad_norm_(one, 0.1)
    expected = torch.nn.utils.clip_grad_norm_(other, 0.1)
    assert torch.equal(total.to_local(), expected.to_local())
    assert torch.equal(one.grad.to_local(), other.grad.to_local())
    assert local_path == [True, True]


def test_gradients_on_equal_meshes_of_different_objects_take_the_local_path(fake2, local_path):
    """A gradient whose mesh is an equal but distinct object (DTensor's sharding cache can
    give an op's output the mesh of an earlier equal call) is on the same mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    mine, theirs = sharded_with_grads(OddMLP), sharded_with_grads(OddMLP)
    for model in (mine, theirs):
        last = list(model.parameters())[-1]
        twin = DeviceMesh.from_group(last.device_mesh.get_group(), "cpu")
        assert twin == last.device_mesh and twin is not last.device_mesh
        last.grad = DTensor.from_local(last.grad.to_local(), twin, last.placements,
                                       shape=last.shape, stride=last.stride())
    _same(mine, graphshard.clip_grad_norm_(mine.parameters(), 0.5),
          theirs, torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5))
    assert local_path == [True]
