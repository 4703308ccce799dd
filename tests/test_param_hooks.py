"""Gradient hooks a user registered on a parameter before ``shard()`` stay on it
(``graphshard.safety.param_hooks``): through ``shard()`` itself, the meta-device recipe's
``to_empty()``, ``.to()`` after sharding, and ``no_sync``. On one real gloo rank; the
numerics of hooks on two ranks against one process are a case of
``tests/test_training_features.py`` (``grad_hooks``), and on HSDP's four ranks under
``no_sync`` one of ``tests/test_accumulation.py`` (``hooked_mlp``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import graphshard


class _Recorder:
    """A tensor hook that doubles the gradient, and a post-accumulate-grad hook, both
    recording what they were given."""

    def __init__(self) -> None:
        self.grads: list[object] = []
        self.params: list[object] = []

    def double(self, grad):
        self.grads.append(grad)
        return grad * 2.0

    def after_accumulation(self, param) -> None:
        self.params.append(param)


def _model(device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _hooked(model: nn.Module, recorder: _Recorder):
    """Register the recorder's hooks on ``model``; the tensor hook's handle."""
    model[2].bias.register_post_accumulate_grad_hook(recorder.after_accumulation)
    return model[0].weight.register_hook(recorder.double)


def _loss(model: nn.Module, seed: int = 0) -> torch.Tensor:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed))
    return model(x.to(next(model.parameters()).dtype)).square().mean()


def _first_weight_grad(hooked: bool) -> torch.Tensor:
    """The unsharded model's gradient of ``0.weight`` (with or without the doubling)."""
    model = _model()
    if hooked:
        _hooked(model, _Recorder())
    _loss(model).backward()
    return model[0].weight.grad


def test_hooks_registered_before_shard_run_on_the_sharded_gradient(one_rank):
    recorder = _Recorder()
    model = _model()
    _hooked(model, recorder)
    graphshard.shard(model)
    _loss(model).backward()
    (grad,) = recorder.grads
    assert isinstance(grad, DTensor), type(grad)  # the sharded parameter's gradient
    assert recorder.params == [model[2].bias]  # handed the sharded parameter
    doubled = _first_weight_grad(True)
    torch.testing.assert_close(model[0].weight.grad.full_tensor(), doubled)
    assert not torch.allclose(doubled, _first_weight_grad(False))


def test_a_kept_handle_still_removes_the_hook(one_rank):
    recorder = _Recorder()
    model = _model()
    handle = _hooked(model, recorder)
    graphshard.shard(model)
    handle.remove()
    _loss(model).backward()
    assert recorder.grads == []
    torch.testing.assert_close(model[0].weight.grad.full_tensor(), _first_weight_grad(False))


@pytest.mark.parametrize("recipe", ["meta_to_empty", "to_float64"])
def test_hooks_survive_new_storage(one_rank, recipe):
    """``to_empty()`` and ``.to()`` swap a DTensor parameter's contents, after which autograd
    no longer called its hooks; they are handed back."""
    recorder = _Recorder()
    model = _model("meta" if recipe == "meta_to_empty" else "cpu")
    _hooked(model, recorder)
    graphshard.shard(model)
    if recipe == "meta_to_empty":
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for layer in (model[0], model[2]):
            layer.reset_parameters()
    else:
        model.to(torch.float64)
    _loss(model).backward()
    assert len(recorder.grads) == 1 and recorder.params == [model[2].bias]


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_under_no_sync_hooks_run_once_on_the_synced_gradient(one_rank, mode):
    """A backward under ``no_sync`` holds the gradient back from the parameter: its hooks are
    not called (eagerly they were called with None, which a hook does not expect). The synced
    backward hands them the sum of the micro-batches."""
    recorder = _Recorder()
    model = _model()
    _hooked(model, recorder)
    graphshard.shard(model)
    run = torch.compile(model, backend=graphshard.backend(inductor=False)) \
        if mode == "compiled" else model
    with graphshard.no_sync(model):
        _loss(run, seed=0).backward()
    assert recorder.grads == [] and recorder.params == []
    _loss(run, seed=1).backward()
    (grad,) = recorder.grads
    assert recorder.params == [model[2].bias]
    reference = _model()
    (_loss(reference, seed=0) + _loss(reference, seed=1)).backward()
    torch.testing.assert_close(grad.full_tensor(), reference[0].weight.grad)
