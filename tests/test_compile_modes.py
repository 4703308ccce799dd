"""``torch.compile(model, backend="graphshard", mode=..., options=...)``: ``options`` are the
backend's options, ``mode`` is Inductor's (``graphshard.compiler.compile_modes``). Before,
either keyword failed at the first call with a ``TypeError`` that named nothing to change."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

import graphshard
from graphshard.compiler.compile_modes import inductor_config_for, without_cuda_graphs
from graphshard.errors import (
    GraphshardNotImplementedError,
    GraphshardTypeError,
    GraphshardValueError,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _step(run: nn.Module, model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward on a fixed batch: the loss and every full gradient."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    loss = run(x).square().mean()
    loss.backward()
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for p in model.parameters()]
    return loss.detach(), grads


def _assert_trains_like_plain(run: nn.Module, model: nn.Module) -> None:
    plain = _model()
    want_loss, want_grads = _step(plain, plain)
    loss, grads = _step(run, model)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_options_are_the_backend_options(one_rank, tmp_path):
    model = graphshard.shard(_model())
    run = torch.compile(model, backend="graphshard",
                        options={"dump_dir": str(tmp_path), "inductor": False})
    _assert_trains_like_plain(run, model)
    dumped = {p.name for p in tmp_path.rglob("*.txt")}  # dump_dir reached the backend
    for stage in ("dynamo", "joint", "fw", "bw"):
        assert any(n.startswith(f"{stage}_") for n in dumped), (stage, sorted(dumped))


def test_an_unknown_option_is_named(one_rank):
    model = graphshard.shard(_model())
    run = torch.compile(model, backend="graphshard", options={"prefech_depth": 2})
    with pytest.raises(Exception, match=r"Unknown graphshard backend option\(s\) "
                       r"\['prefech_depth'\]; known: .*prefetch_depth"):
        run(torch.randn(2, 16))


def test_mode_compiles_forward_and_backward_under_it(one_rank, monkeypatch):
    """``mode="max-autotune-no-cudagraphs"``: Inductor compiles the forward and the backward
    with autotuning on (AOTAutograd's and Inductor's caches off, so that both compile here),
    and the step is the plain model's."""
    from torch._functorch import config as functorch_config
    from torch._inductor import compile_fx
    from torch._inductor import config as inductor_config

    seen = []
    real = compile_fx.compile_fx_inner

    def spy(gm, example_inputs, **kwargs):
        seen.append((bool(kwargs.get("is_backward")), inductor_config.max_autotune,
                     inductor_config.coordinate_descent_tuning))
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", spy)
    model = graphshard.shard(_model())
    run = torch.compile(model, backend="graphshard", mode="max-autotune-no-cudagraphs")
    # the configs' own patch: torch 2.11's config module is left broken by monkeypatch's undo
    with functorch_config.patch(enable_autograd_cache=False), \
            inductor_config.patch(fx_graph_cache=False):
        _assert_trains_like_plain(run, model)
    assert sorted(seen) == [(False, True, True), (True, True, True)], seen
    assert inductor_config.max_autotune is False  # only while graphshard compiled


def test_cuda_graphs_raise_on_a_cuda_graph_and_are_left_out_on_the_cpu():
    with FakeTensorMode():
        on_cuda = [torch.empty(4, device="cuda")]
    on_cpu = [torch.empty(4)]
    for mode in ("reduce-overhead", "max-autotune"):
        config = inductor_config_for(mode, inductor=True)
        assert config["triton.cudagraphs"] is True
        with pytest.raises(GraphshardNotImplementedError,
                           match=rf"mode '{mode}' records CUDA graphs.*"
                                 r"mode='max-autotune-no-cudagraphs'"):
            without_cuda_graphs(config, mode, on_cuda)
        left = without_cuda_graphs(config, mode, on_cpu)
        assert left == {k: v for k, v in config.items() if k != "triton.cudagraphs"}
    no_graphs = inductor_config_for("max-autotune-no-cudagraphs", inductor=True)
    assert without_cuda_graphs(no_graphs, "max-autotune-no-cudagraphs", on_cuda) == no_graphs
    assert inductor_config_for(None, inductor=True) == inductor_config_for("default", True) == {}


def test_bad_modes_and_inductor_settings_say_what_to_change():
    with pytest.raises(GraphshardValueError, match=r"Unknown torch.compile mode 'fast'.*"
                       r"'max-autotune-no-cudagraphs'"):
        graphshard.backend(mode="fast")
    with pytest.raises(GraphshardValueError, match="inductor=False compiles nothing"):
        graphshard.backend(mode="max-autotune-no-cudagraphs", inductor=False)
    with pytest.raises(GraphshardTypeError, match=r"max_autotune: Inductor's, set on "
                       r"torch._inductor.config"):
        graphshard.backend(max_autotune=True)


def test_a_backend_object_takes_torch_compiles_mode_and_refuses_its_options(one_rank):
    """torch hands a backend object torch.compile's ``mode`` and ``options`` too."""
    model = graphshard.shard(_model())
    # on the CPU, reduce-overhead's CUDA graphs are left out (as Inductor does there)
    _assert_trains_like_plain(
        torch.compile(model, backend=graphshard.backend(), mode="reduce-overhead"), model)
    x = torch.randn(2, 16)
    for kwargs, message in (
        ({"backend": graphshard.backend(mode="max-autotune-no-cudagraphs"),
          "mode": "reduce-overhead"},
         r"mode='reduce-overhead'\) with a graphshard backend built with "
         r"mode='max-autotune-no-cudagraphs': give one of them"),
        ({"backend": graphshard.backend(), "options": {"prefetch_depth": 1}},
         r"pass them to graphshard.backend\(...\) instead"),
    ):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=message):
            torch.compile(model, **kwargs)(x)
