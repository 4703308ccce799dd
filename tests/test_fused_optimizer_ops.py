"""``graphshard.api.fused_optimizer_ops``: a fused optimizer's step on sharded parameters runs
on the local tensors, with DTensor's own result bit for bit, and whatever the local path cannot
serve still goes through DTensor's dispatch."""

from __future__ import annotations

import pytest
import torch
from graph_utils import sharded_with_grads
from torch.distributed.tensor import DTensor, Replicate

import graphshard
from graphshard.api import fused_optimizer_ops
from graphshard.models.llama import Llama, llama_config
from graphshard.models.mlp import OddMLP

aten = torch.ops.aten
HANDLERS = DTensor._op_dispatcher._custom_op_handlers

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, fused=True),
    "adamw-tensor-lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2, fused=True),
}


@pytest.fixture
def spy(monkeypatch):
    """How many fused calls ran locally and how many went to DTensor's dispatch."""
    seen = {"local": 0, "dtensor": 0}
    localized = fused_optimizer_ops._localized

    def counting(args, kwargs):
        out = localized(args, kwargs)
        seen["local" if out is not None else "dtensor"] += 1
        return out

    monkeypatch.setattr(fused_optimizer_ops, "_localized", counting)
    return seen


def _states(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                out.append(value.to_local() if isinstance(value, DTensor) else value)
    return out


# The fused steps DTensor's dispatch has a sharding rule for (SGD's and Adagrad's have none:
# on DTensor parameters they raise without the local path).
DTENSOR_RUNS = {"adamw", "adam-amsgrad", "adamw-tensor-lr"}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("build", [OddMLP, lambda: Llama(llama_config("tiny"))],
                         ids=["odd-mlp", "llama"])
def test_a_fused_step_on_shards_runs_locally_with_the_exact_result(fake2, spy, name, build):
    """Three steps on the shards (uneven ones in the odd MLP) equal, bit for bit, the same
    optimizer on plain copies of the local tensors and, where DTensor can run the op,
    DTensor's own dispatch; parameters keep their placements."""
    model = sharded_with_grads(build)  # shard() installs the local path
    plain = [torch.nn.Parameter(p.to_local().clone()) for p in model.parameters()]
    for copy, p in zip(plain, model.parameters(), strict=True):
        copy.grad = p.grad.to_local().clone()
    ours, on_plain = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](plain)
    for _ in range(3):
        ours.step()
        on_plain.step()
    assert spy == {"local": 3, "dtensor": 0}
    for mine, ref in zip(model.parameters(), plain, strict=True):
        assert torch.equal(mine.to_local(), ref)
    assert all(torch.equal(a, b) for a, b in zip(_states(ours), _states(on_plain), strict=True))
    if name not in DTENSOR_RUNS:
        return
    reference = sharded_with_grads(build)
    theirs = OPTIMIZERS[name](reference.parameters())
    with fused_optimizer_ops.dtensor_dispatch():
        for _ in range(3):
            theirs.step()
    assert spy == {"local": 3, "dtensor": 0}  # the reference never reached the handler
    for mine, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.to_local(), ref.to_local())
        assert mine.placements == ref.placements
    assert all(torch.equal(a, b) for a, b in zip(_states(ours), _states(theirs), strict=True))


def test_a_call_with_other_placements_goes_through_dtensor(fake2, spy):
    """Gradients replicated beside sharded parameters: DTensor redistributes them, so the
    call is not elementwise on the local tensors and takes DTensor's path, with its result."""
    model, reference = sharded_with_grads(OddMLP), sharded_with_grads(OddMLP)
    for p in [*model.parameters(), *reference.parameters()]:
        p.grad = p.grad.redistribute(p.device_mesh, [Replicate()])
    torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True).step()
    assert spy == {"local": 0, "dtensor": 1}
    with fused_optimizer_ops.dtensor_dispatch():
        torch.optim.AdamW(reference.parameters(), lr=1e-2, fused=True).step()
    assert spy == {"local": 0, "dtensor": 1}  # the reference never reached the handler
    for mine, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.to_local(), ref.to_local())
    assert HANDLERS[aten._fused_adamw_.default] is fused_optimizer_ops._local_or_default


def test_dtensor_parameters_not_made_by_shard_keep_dtensors_dispatch(fake2, spy):
    """Another library's DTensor parameters (here: distribute_tensor's, as FSDP2 makes
    them) are stepped by DTensor's dispatch even once graphshard's path is installed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded_with_grads(OddMLP)  # installs the local path
    mesh = init_device_mesh("cpu", (2,))
    theirs = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]))
    theirs.grad = distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
    torch.optim.AdamW([theirs], lr=1e-2, fused=True).step()
    assert spy == {"local": 0, "dtensor": 1}


def test_shard_installs_the_local_path_once_and_keeps_other_handlers(fake2, monkeypatch):
    monkeypatch.setattr(fused_optimizer_ops, "_installed", False)
    theirs = object()
    monkeypatch.setitem(HANDLERS, aten._fused_sgd_.default, theirs)
    graphshard.shard(OddMLP())
    assert HANDLERS[aten._fused_adamw_.default] is fused_optimizer_ops._local_or_default
    assert HANDLERS[aten._fused_sgd_.default] is theirs  # a handler already there is kept
    assert not any(str(op).startswith("aten._foreach") for op in fused_optimizer_ops.LOCAL_OPS)


def test_the_local_path_survives_to_empty_of_a_meta_built_model(fake2, spy):
    """FSDP2's meta-init recipe: build on the meta device, shard, ``to_empty``, initialise.
    ``to_empty`` swaps each parameter's contents (keeping the object), so the fused step
    still runs locally, with the plain optimizer's result."""
    with torch.device("meta"):
        model = OddMLP()
    graphshard.shard(model)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        with torch.no_grad():
            p.to_local().normal_(generator=gen)
        p.grad = DTensor.from_local(torch.randn(p.to_local().shape, generator=gen),
                                    p.device_mesh, p.placements, shape=p.shape,
                                    stride=p.stride())
    plain = [torch.nn.Parameter(p.to_local().clone()) for p in model.parameters()]
    for copy, p in zip(plain, model.parameters(), strict=True):
        copy.grad = p.grad.to_local().clone()
    OPTIMIZERS["adamw"](model.parameters()).step()
    OPTIMIZERS["adamw"](plain).step()
    assert spy == {"local": 1, "dtensor": 0}
    assert all(torch.equal(p.to_local(), q) for p, q in zip(model.parameters(), plain, strict=True))


def test_an_ordinary_step_is_checked_without_the_per_tensor_loop(fake2, spy, monkeypatch):
    """The step every training loop makes (lists of DTensors on their parameters' specs, the
    step counts as 0-dim tensors) is served by the check that works list by list; the spec
    lists it has compared are remembered, so the next step compares none."""
    model = sharded_with_grads(OddMLP)

    def per_tensor(lists):
        raise AssertionError("the ordinary step reached the per-tensor check")

    compared = []
    agree = fused_optimizer_ops._specs_agree
    monkeypatch.setattr(fused_optimizer_ops, "_first_dtensors", per_tensor)
    monkeypatch.setattr(fused_optimizer_ops, "_specs_agree",
                        lambda *specs: compared.append(specs) or agree(*specs))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True, fused=True)
    optimizer.step()
    first = len(compared)
    assert first > 0  # the moments' specs are objects of their own, compared once
    optimizer.step()
    assert spy == {"local": 2, "dtensor": 0}
    assert len(compared) == first


def test_a_step_on_a_list_of_another_spec_is_not_served_from_memory(fake2, spy):
    """A moment whose spec no longer agrees with its parameter's (replicated here) sends the
    step to DTensor's dispatch even after steps that ran locally with the same lists."""
    model = sharded_with_grads(OddMLP)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    optimizer.step()
    state = optimizer.state[next(iter(model.parameters()))]
    state["exp_avg"] = state["exp_avg"].redistribute(state["exp_avg"].device_mesh, [Replicate()])
    assert fused_optimizer_ops._localized_uniform(*_fused_call(optimizer)) is None
    assert fused_optimizer_ops._localized(*_fused_call(optimizer)) is None


def test_a_moment_on_an_equal_mesh_of_another_object_steps_locally(fake2, spy):
    """A moment whose mesh is an equal but distinct object (DTensor's sharding cache can give
    an op's output the mesh of an earlier equal call) is on the parameter's mesh: the step
    stays local, and equals DTensor's own."""
    from torch.distributed.device_mesh import DeviceMesh

    models = sharded_with_grads(OddMLP), sharded_with_grads(OddMLP)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in models]
    for model, optimizer in zip(models, optimizers, strict=True):
        optimizer.step()
        last = list(model.parameters())[-1]
        twin = DeviceMesh.from_group(last.device_mesh.get_group(), "cpu")
        assert twin == last.device_mesh and twin is not last.device_mesh
        moment = optimizer.state[last]["exp_avg"]
        optimizer.state[last]["exp_avg"] = DTensor.from_local(
            moment.to_local(), twin, moment.placements, shape=moment.shape,
            stride=moment.stride())
    optimizers[0].step()
    assert spy == {"local": 3, "dtensor": 0}  # both first steps, and this one
    with fused_optimizer_ops.dtensor_dispatch():
        optimizers[1].step()
    for mine, ref in zip(*(m.parameters() for m in models), strict=True):
        assert torch.equal(mine.to_local(), ref.to_local())
    assert all(torch.equal(a, b) for a, b in zip(*map(_states, optimizers), strict=True))


def test_zero_dim_dtensors_on_an_equal_mesh_of_another_object_step_locally(fake2, spy):
    """A learning rate and a step count held as replicated 0-dim DTensors, one on the
    parameters' mesh and one on an equal but distinct mesh object, are the same mesh's: the
    call is served on the local tensors, with each 0-dim DTensor's local value."""
    from torch.distributed.device_mesh import DeviceMesh

    model = sharded_with_grads(OddMLP)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    optimizer.step()
    mesh = next(iter(model.parameters())).device_mesh
    twin = DeviceMesh.from_group(mesh.get_group(), "cpu")
    assert twin == mesh and twin is not mesh
    args, kwargs = _fused_call(optimizer)
    kwargs["lr"] = DTensor.from_local(torch.tensor(1e-2), twin, [Replicate()])
    kwargs["grad_scale"] = DTensor.from_local(torch.tensor(1.0), mesh, [Replicate()])
    local = fused_optimizer_ops._localized(args, kwargs)
    assert local is not None
    local_args, local_kwargs = local
    for key in ("lr", "grad_scale"):
        assert local_kwargs[key] is kwargs[key]._local_tensor
    assert all(type(t) is torch.Tensor for t in local_args[0])


def _fused_call(optimizer: torch.optim.Optimizer) -> tuple[tuple, dict]:
    """The arguments AdamW's fused step passes ``_fused_adamw_`` for ``optimizer``'s group."""
    group = optimizer.param_groups[0]
    params = [p for p in group["params"] if p.grad is not None]
    states = [optimizer.state[p] for p in params]
    args = (params, [p.grad for p in params], [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states])
    return args, {"lr": group["lr"], "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.01,
                  "eps": 1e-8, "amsgrad": False, "maximize": False}


def test_the_remembered_spec_lists_go_with_their_model(fake2):
    """The lists of specs found to agree hold the specs (and their mesh) alive; they are
    dropped when the sharded model is garbage."""
    import gc

    model = sharded_with_grads(OddMLP)
    torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True).step()
    assert fused_optimizer_ops._AGREED
    del model
    gc.collect()
    assert not fused_optimizer_ops._AGREED
