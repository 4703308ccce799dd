"""Trainable sharded parameters enter the compiled graphs as plain tensors
(``graphshard.api.local_inputs``): no DTensor guards or gradient wrapping in a compiled step,
while the parameters' ``.grad``, hooks, ``autograd.grad`` and ``backward(inputs=...)`` behave
as for the eager model, through freezing, accumulation and new storage."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import graphshard
from graphshard.api.sharding import shard_state
from graphshard.models.llama import Llama, llama_config

CFG = llama_config("tiny", tie_embeddings=True)


def _pair():
    """The same sharded model twice: compiled with graphshard, and eager (the reference,
    whose gradients reach the DTensor parameters through autograd itself)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(graphshard.shard(Llama(CFG)))
    compiled, eager = models
    return compiled, torch.compile(compiled, backend=graphshard.backend()), eager


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))


def _backward(run, tokens: torch.Tensor) -> float:
    loss = run(tokens).loss
    loss.backward()
    return loss.item()


def _assert_grads_match(model, reference) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
            continue
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements, name
        torch.testing.assert_close(p.grad.full_tensor(), q.grad.full_tensor(), msg=name)


def test_a_compiled_step_builds_no_dtensor_spec(one_rank, monkeypatch):
    """A warm compiled forward and backward build no DTensor from its flattened parts (its
    inputs and gradients are plain tensors; before, AOTAutograd rebuilt every parameter's
    gradient with ``DTensor.__tensor_unflatten__``), and the gradients are a DTensor on each
    parameter's own layout, equal to the eager model's."""
    model, run, eager = _pair()
    for seed in range(2):
        _backward(run, _batch(seed))
        model.zero_grad(set_to_none=True)
    built = []
    unflatten = DTensor.__tensor_unflatten__

    def counted(*args, **kwargs):
        built.append(1)
        return unflatten(*args, **kwargs)

    monkeypatch.setattr(DTensor, "__tensor_unflatten__", staticmethod(counted))
    _backward(run, _batch(5))
    monkeypatch.undo()
    assert built == []
    _backward(eager, _batch(5))
    _assert_grads_match(model, eager)


class _DTensorOps(TorchDispatchMode):
    """Counts the ops that reach the dispatcher with a DTensor among their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, DTensor) for a in pytree.tree_leaves((args, kwargs or {}))):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_compiled_backward_sets_the_gradients_without_dtensor_ops(one_rank):
    """A plain ``backward()`` hands every gradient to its parameter without one DTensor op
    (before, each parameter's ``AccumulateGrad`` detached its DTensor gradient through
    DTensor's dispatch), all through one backward node; a second backward accumulates in
    place, and ``.grad`` equals the eager model's after both."""
    model, run, eager = _pair()
    _backward(run, _batch(0))
    model.zero_grad(set_to_none=True)
    nodes = {id(entry.local.grad_fn) for entry in shard_state(model).params}
    assert len(nodes) == 1
    for seed in (1, 2):
        loss = run(_batch(seed)).loss
        with _DTensorOps() as seen:
            loss.backward()
        assert seen.ops == [], seen.ops[:5]
        _backward(eager, _batch(seed))
    _assert_grads_match(model, eager)


def _second_backward_counting_inits(monkeypatch):
    """The pair's compiled model after a second backward (new ``.grad`` tensors), with the
    calls of ``DTensor.__init__`` that backward made."""
    model, run, eager = _pair()
    _backward(run, _batch(0))
    model.zero_grad(set_to_none=True)
    inits = []
    init = DTensor.__init__
    monkeypatch.setattr(DTensor, "__init__", lambda self, *a, **k: inits.append(1) or init(
        self, *a, **k))
    _backward(run, _batch(1))
    return model, eager, inits


def test_gradients_are_made_without_dtensors_python_init(one_rank, monkeypatch):
    """The backward makes each new ``.grad`` with DTensor's C++ constructor alone (its
    ``__init__`` does nothing but run three Python wrappers): the same object
    ``DTensor(grad, spec, requires_grad=False)`` makes, on the parameter's own spec."""
    model, eager, inits = _second_backward_counting_inits(monkeypatch)
    assert inits == []
    for p in model.parameters():
        reference = DTensor(p.grad._local_tensor, p._spec, requires_grad=False)
        assert type(p.grad) is DTensor and p.grad._spec is p._spec
        assert not p.grad.requires_grad and p.grad.stride() == reference.stride()
        assert p.grad.shape == reference.shape and p.grad.dtype == reference.dtype
    assert len(inits) == len(list(model.parameters()))  # the check's own references
    _backward(eager, _batch(1))
    _assert_grads_match(model, eager)


def test_without_the_cpp_constructor_gradients_come_from_the_class(one_rank, monkeypatch):
    """Where DTensor's constructor is not the C++ one (no torch from 2.11 to 2.14.1, but a
    release may change it) the backward builds each ``.grad`` with ``DTensor(...)``, and the
    gradients are the same."""
    from graphshard.api import dtensor_handlers

    monkeypatch.setattr(dtensor_handlers, "_DTENSOR_NEW", None)
    model, eager, inits = _second_backward_counting_inits(monkeypatch)
    assert len(inits) == len(list(model.parameters()))  # one constructor call per gradient
    assert all(p.grad._spec is p._spec for p in model.parameters())
    _backward(eager, _batch(1))
    _assert_grads_match(model, eager)


def test_autograd_grad_and_backward_inputs_reach_the_parameters(one_rank):
    """``torch.autograd.grad(loss, params)`` and ``loss.backward(inputs=params)`` on the
    compiled model give the eager model's gradients (the plain tensors stay linked to the
    parameters in autograd's graph)."""
    model, run, eager = _pair()
    _backward(run, _batch(0))
    model.zero_grad(set_to_none=True)
    grads = torch.autograd.grad(run(_batch(1)).loss, list(model.parameters()))
    wanted = torch.autograd.grad(eager(_batch(1)).loss, list(eager.parameters()))
    for got, want in zip(grads, wanted, strict=True):
        torch.testing.assert_close(got.full_tensor(), want.full_tensor())
    some = [model.layers[0].attention.wq.weight, model.norm.weight]
    run(_batch(2)).loss.backward(inputs=some)
    eager_some = [eager.layers[0].attention.wq.weight, eager.norm.weight]
    eager(_batch(2)).loss.backward(inputs=eager_some)
    _assert_grads_match(model, eager)


class _Residual(nn.Module):
    """Two residual MLP blocks and a head: every operation twice differentiable (the tiny
    Llama's CPU attention is not), and saved activations the backward may donate."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x).square().mean()


def _residual_pair():
    """The plain model, the same sharded and compiled without Inductor (AOTAutograd's
    runtime, which these tests are about, is the same), and the same sharded, eager."""
    torch.manual_seed(0)
    plain = _Residual()
    model, eager = graphshard.shard(copy.deepcopy(plain)), graphshard.shard(copy.deepcopy(plain))
    return plain, model, torch.compile(model, backend=graphshard.backend(inductor=False)), eager


def _inputs(seed: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))


def test_a_gradient_penalty_through_the_compiled_step_is_refused_not_dropped(one_rank):
    """``autograd.grad(..., create_graph=True)`` through the compiled step gives gradients
    that keep their history, so a loss built from them reaches the compiled backward, which
    refuses a double backward as plain ``torch.compile`` does. (Before, the gradients came
    back detached: ``loss + penalty`` trained on ``loss`` alone, silently.) The eager sharded
    model trains on the penalty as the plain model does."""
    from graphshard.api.eager_kernels import _to_local_keeps_history

    plain, model, run, eager = _residual_pair()
    pairs = [(plain, plain), (model, run)]
    if _to_local_keeps_history():  # torch 2.11: the next test
        pairs.append((eager, eager))
    for m, forward in pairs:
        loss = forward(_inputs(0))
        grads = torch.autograd.grad(loss, list(m.parameters()), create_graph=True)
        assert all(g.requires_grad for g in grads)
        penalty = sum((g.to_local() if isinstance(g, DTensor) else g).square().sum()
                      for g in grads)
        if m is model:
            with pytest.raises(RuntimeError, match="double backward"):
                (loss + penalty).backward()
        else:
            (loss + penalty).backward()
    for (name, p), q in zip(eager.named_parameters(), plain.parameters(), strict=True):
        if _to_local_keeps_history():  # torch 2.11: the next test
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def test_a_gradient_penalty_on_torch_2_11_is_refused_eagerly_not_dropped(one_rank, monkeypatch):
    """torch 2.11's ``DTensor.to_local()`` backward drops the gradient's history (2.12 fixed
    it), so there the eager sharded model refuses ``create_graph`` with an error naming the
    version, where the penalty would otherwise add nothing. Run on every torch by standing
    in for 2.11's answer."""
    from graphshard._torch_version import installed_torch_version
    from graphshard.api import eager_kernels

    assert eager_kernels._to_local_keeps_history() is (installed_torch_version() >= (2, 12))
    monkeypatch.setattr(eager_kernels, "_to_local_keeps_history", lambda: False)
    _, _, _, eager = _residual_pair()
    loss = eager(_inputs(0))
    with pytest.raises(graphshard.GraphshardError, match="needs torch 2.12 or newer"):
        torch.autograd.grad(loss, list(eager.parameters()), create_graph=True)
    eager(_inputs(1)).backward()  # without create_graph it trains as before
    assert all(p.grad is not None for p in eager.parameters())


def test_retain_graph_backwards_twice_with_donated_buffers_off(one_rank):
    """As with plain ``torch.compile``, a backward compiled for a ``backward()`` that frees
    the graph donates the saved activations' buffers, so a later ``retain_graph=True`` is
    refused with an error that says what to set; with torch's ``donated_buffer`` off, two
    backwards of one forward accumulate what the eager model does."""
    _, model, run, eager = _residual_pair()
    run(_inputs(0)).backward()
    with pytest.raises(RuntimeError, match="donated_buffer=False"):
        run(_inputs(0)).backward(retain_graph=True)
    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    with torch._functorch.config.patch(donated_buffer=False):
        run = torch.compile(model, backend=graphshard.backend(inductor=False))
        for forward in (run, eager):
            forward(_inputs(0)).backward()
            loss = forward(_inputs(1))
            loss.backward(retain_graph=True)
            loss.backward()
    _assert_grads_match(model, eager)


def test_parameter_hooks_run_as_autograd_runs_them(one_rank):
    """A tensor hook on a parameter changes its gradient, and a post-accumulate-grad hook
    sees ``.grad`` in place, once per backward (both run by autograd in the eager model)."""
    model, run, eager = _pair()
    seen = {"compiled": [], "eager": []}
    for which, m in (("compiled", model), ("eager", eager)):
        wq = m.layers[0].attention.wq.weight
        wq.register_hook(lambda grad: grad * 3)
        w2 = m.layers[1].feed_forward.w2.weight
        w2.register_post_accumulate_grad_hook(
            lambda p, which=which: seen[which].append(p.grad.full_tensor().norm().item()))
    for seed in range(2):  # the second backward accumulates into the first's .grad
        _backward(run, _batch(seed))
        _backward(eager, _batch(seed))
    _assert_grads_match(model, eager)
    assert len(seen["compiled"]) == 2
    torch.testing.assert_close(torch.tensor(seen["compiled"]), torch.tensor(seen["eager"]))


def test_freezing_and_unfreezing_after_compiling(one_rank):
    """``requires_grad_(False)`` after the first compiled step: that parameter gets no
    gradient and the optimizer leaves it alone; set back to True, it trains again. Step by
    step as the eager model."""
    model, run, eager = _pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]

    def step(seed: int) -> None:
        for r in (run, eager):
            _backward(r, _batch(seed))
        _assert_grads_match(model, eager)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    step(0)
    frozen = [m.layers[1].attention.wv.weight for m in (model, eager)]
    before = frozen[0].full_tensor().clone()
    for p in frozen:
        p.requires_grad_(False)
    step(1)
    step(2)
    torch.testing.assert_close(frozen[0].full_tensor(), before, rtol=0, atol=0)
    for p in frozen:
        p.requires_grad_(True)
    step(3)
    assert not torch.equal(frozen[0].full_tensor(), before)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        # Adam's first steps scale compiled-vs-eager round-off in the gradients up to ~lr
        torch.testing.assert_close(p.full_tensor(), q.full_tensor(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("compile_blocks_once", [True, False], ids=["regions", "inline"])
def test_unfreezing_a_whole_module_trains_each_of_its_parameters(one_rank,
                                                                  compile_blocks_once):
    """A block frozen after the first compiled step, then unfrozen: every parameter of each
    of its layers gets its gradient again, the bias read after the weight too. (Dynamo takes
    a module's dict of plain tensors as it is when first read, at the weight; the bias's
    tensor, re-made after that, was traced frozen and got no gradient.)"""
    torch.manual_seed(0)
    plain = _Residual()
    model = graphshard.shard(copy.deepcopy(plain), compile_blocks_once=compile_blocks_once)
    run = torch.compile(model, backend=graphshard.backend(inductor=False))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]

    def step(seed: int) -> None:
        run(_inputs(seed)).backward()
        plain(_inputs(seed)).backward()
        for (name, want), got in zip(plain.named_parameters(), model.parameters(), strict=True):
            assert (got.grad is None) == (want.grad is None), name
            if want.grad is not None:
                torch.testing.assert_close(got.grad.full_tensor(), want.grad, msg=name)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    step(0)
    for m in (model, plain):
        m.blocks[0].requires_grad_(False)
        m.head.bias.requires_grad_(False)
    step(1)
    step(2)
    for m in (model, plain):
        m.blocks[0].requires_grad_(True)
    step(3)
    step(4)
    for (name, want), got in zip(plain.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(got.full_tensor(), want.detach(), msg=name)


@pytest.mark.parametrize("renew", ["to_empty", "assign"])
def test_the_compiled_model_reads_parameters_given_new_storage(one_rank, renew):
    """After a compiled step, the parameters get new storage (``to_empty`` then values
    copied in, or ``load_state_dict(assign=True)`` of new DTensor Parameters): the next
    compiled step computes with the new values, as the eager model does."""
    model, run, eager = _pair()
    _backward(run, _batch(0))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    first = {}  # every name of a parameter (tied ones too) -> its first name
    for name, p in eager.named_parameters(remove_duplicate=False):
        first[name] = next(n for n, q in eager.named_parameters() if q is p)
    values = {name: p.full_tensor() * 0.5 + 0.01 * torch.randn(p.shape)
              for name, p in eager.named_parameters()}
    for m in (model, eager):
        targets = dict(m.named_parameters(remove_duplicate=False))
        if renew == "to_empty" or m is eager:
            if renew == "to_empty":
                buffers = {name: b.clone() for name, b in m.named_buffers()}
                m.to_empty(device="cpu")
                with torch.no_grad():
                    for name, b in m.named_buffers():
                        b.copy_(buffers[name])
            with torch.no_grad():
                for name, full in values.items():
                    targets[name].to_local().copy_(full)  # world 1: the shard is the whole
        else:  # new Parameters under every name, tied names given equal values
            new = {name: torch.nn.Parameter(DTensor.from_local(
                values[first[name]].clone(), p.device_mesh, p.placements))
                for name, p in targets.items()}
            m.load_state_dict(new, assign=True)
    assert _backward(run, _batch(1)) == pytest.approx(_backward(eager, _batch(1)), rel=1e-5)
    _assert_grads_match(model, eager)


class _Convs(nn.Module):
    """A convolutional stem, two residual convolutions and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean((2, 3))).square().mean()


def test_channels_last_after_shard_trains_compiled(one_rank):
    """``model.to(memory_format=torch.channels_last)`` after ``shard()`` gives the
    convolutions' shards other strides, and swaps every DTensor parameter's contents, the
    unchanged ones too (``Module._apply``). Compiled steps train as the unsharded
    channels-last model. (Before, the gather flattened a shard with ``view(-1)``, which the
    new strides refuse, and the Linear's gradient went to the ``AccumulateGrad`` node that
    the swap had poisoned.)"""
    torch.manual_seed(0)
    plain = _Convs()
    model = graphshard.shard(copy.deepcopy(plain))
    plain, model = (m.to(memory_format=torch.channels_last) for m in (plain, model))
    assert model.stem.weight.to_local().is_contiguous(memory_format=torch.channels_last)
    run = torch.compile(model, backend=graphshard.backend(inductor=False))
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randn(2, 3, 8, 8, generator=gen).to(memory_format=torch.channels_last)
        loss, want = run(x), plain(x)
        torch.testing.assert_close(loss, want)
        loss.backward()
        want.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


def test_a_parameter_frozen_before_sharding_trains_once_unfrozen(one_rank):
    """Frozen before ``shard()``, a parameter is read through its DTensor; set trainable
    after a compiled step, it gets its gradient like the eager model's."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        plain = Llama(CFG)
        plain.layers[0].feed_forward.w1.weight.requires_grad_(False)
        models.append(graphshard.shard(plain))
    model, eager = models
    run = torch.compile(model, backend=graphshard.backend())
    _backward(run, _batch(0))
    _backward(eager, _batch(0))
    _assert_grads_match(model, eager)
    assert model.layers[0].feed_forward.w1.weight.grad is None
    for m in (model, eager):
        m.zero_grad(set_to_none=True)
        m.layers[0].feed_forward.w1.weight.requires_grad_(True)
    _backward(run, _batch(1))
    _backward(eager, _batch(1))
    assert model.layers[0].feed_forward.w1.weight.grad is not None
    _assert_grads_match(model, eager)
