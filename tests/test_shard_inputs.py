"""Parameters and call patterns that ``shard()`` must take or refuse clearly: a
non-contiguous parameter (stored contiguous, as FSDP2 does), a complex parameter (refused,
naming the real-view form that works), and a method other than ``forward``
(``graphshard.register_forward_method``)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from graph_utils import fake_process_group
from torch import nn

import graphshard
from graphshard.api.sharding import shard_state


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 5).t())  # (5, 8), strides (1, 5)

    def forward(self, x):
        return x @ self.w


def test_a_non_contiguous_parameter_is_stored_contiguous_and_compiles():
    with fake_process_group(2):
        model = graphshard.shard(Transposed())
        local = model.w.to_local()
        assert local.shape == (3, 8) and local.is_contiguous()
        compiled = torch.compile(model, backend=graphshard.backend(inductor=False),
                                 fullgraph=True)
        compiled(torch.randn(3, 5)).sum().backward()  # was a GraphLoweringError
        assert model.w.grad.to_local().shape == (3, 8)


def test_a_non_contiguous_meta_parameter_is_contiguous_after_to_empty():
    with fake_process_group(2):
        with torch.device("meta"):
            model = Transposed()
        graphshard.shard(model)
        model.to_empty(device="cpu")
        assert model.w.to_local().is_contiguous()


class Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.real = nn.Linear(4, 4)
        self.z = nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))


def test_a_complex_parameter_is_refused_naming_the_real_view():
    with fake_process_group(2):
        model = Complex()
        with pytest.raises(graphshard.GraphshardError,
                           match=r"complex parameters: 'z' \(complex64\).*view_as_real.*"
                                 r"view_as_complex"):
            graphshard.shard(model)
        assert not graphshard.api.sharding.is_sharded(model)
        assert not hasattr(model.real.weight, "device_mesh")  # nothing was replaced


@pytest.mark.parametrize("layer", [nn.Embedding(16, 4, sparse=True),
                                   nn.EmbeddingBag(16, 4, sparse=True)],
                         ids=["Embedding", "EmbeddingBag"])
def test_an_embedding_with_sparse_gradients_is_refused_naming_the_dense_one(layer):
    with fake_process_group(2):
        model = nn.Sequential(nn.Linear(4, 4), layer)
        with pytest.raises(graphshard.GraphshardError,
                           match=r"sparse gradients: '1' \(sparse=True\).*sparse=False"):
            graphshard.shard(model)
        assert not graphshard.api.sharding.is_sharded(model)
        assert not hasattr(model[0].weight, "device_mesh")  # nothing was replaced


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.w = nn.Parameter(torch.randn(6, 3))

    def encode(self, x):
        return self.a(x) @ self.w

    def forward(self, x):
        return self.encode(x).sum()  # a registered method called inside forward: plain call


def test_an_unregistered_method_fails_and_a_registered_one_gathers(one_rank):
    torch.manual_seed(0)
    plain = Encoder()
    torch.manual_seed(0)
    model = graphshard.shard(Encoder())
    x = torch.randn(2, 5)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        model.encode(x)
    graphshard.register_forward_method(model, "encode")
    graphshard.register_forward_method(model, "encode")  # twice: once
    torch.testing.assert_close(model.encode(x), plain.encode(x))
    torch.testing.assert_close(model(x), plain(x))
    assert shard_state(model).forward_depth == 0
    assert isinstance(model.w, torch.distributed.tensor.DTensor)  # outside again: sharded
    model.encode(x).sum().backward()
    plain.encode(x).sum().backward()
    torch.testing.assert_close(model.w.grad.full_tensor(), plain.w.grad)


def test_a_registered_method_unwinds_the_forward_count_on_an_error(one_rank):
    model = graphshard.shard(Encoder())
    graphshard.register_forward_method(model, "encode")
    with pytest.raises(RuntimeError):
        model.encode(torch.randn(2, 7))  # wrong width
    assert shard_state(model).forward_depth == 0


def test_a_registered_method_applies_the_roots_mixed_precision(one_rank):
    policy = graphshard.MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    model = graphshard.shard(Encoder(), mixed_precision=policy)
    graphshard.register_forward_method(model, "encode")
    assert model.encode(torch.randn(2, 5)).dtype == torch.float32  # inputs cast, output cast


def test_register_forward_method_compiled_through_the_wrapper(one_rank):
    model = graphshard.shard(Encoder())
    graphshard.register_forward_method(torch.compile(model, backend="graphshard"), "encode")
    encode = torch.compile(model.encode, backend=graphshard.backend(inductor=False),
                           fullgraph=True)
    encode(torch.randn(2, 5)).sum().backward()
    assert model.w.grad is not None and shard_state(model).forward_depth == 0


def test_register_forward_method_refuses_what_it_cannot_wrap():
    with pytest.raises(graphshard.GraphshardError, match="not sharded: call graphshard.shard"):
        graphshard.register_forward_method(Encoder(), "encode")
    with fake_process_group(2):
        model = graphshard.shard(Encoder())
        with pytest.raises(graphshard.GraphshardError, match="has no method 'decode'"):
            graphshard.register_forward_method(model, "decode")


def test_odd_parameters_and_forward_methods_train_like_one_process():
    """World 2, one launch: a transposed parameter, a complex one as its real view, and
    ``encode`` called directly, each eager and compiled, against the unsharded model."""
    import shard_inputs_jobs as jobs

    ref_losses, ref_state = jobs.reference()
    ranks = run_ranks(jobs.run_modes, 2)
    for mode in ranks[0]:
        losses = [torch.stack(r[mode][0]) for r in ranks]
        torch.testing.assert_close((losses[0] + losses[1]) / 2, torch.stack(ref_losses),
                                   msg=mode)
        for name, value in ref_state.items():
            for r in ranks:
                torch.testing.assert_close(r[mode][1][name], value, msg=f"{mode} {name}")
