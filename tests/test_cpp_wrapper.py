"""``torch._inductor.config.cpp_wrapper`` reaches graphshard's graphs
(``graphshard/compiler/wrapper_choice.py``): a graph torch's C++ wrapper can call is wrapped in
C++ and trains as the Python-wrapped one does; a graph it cannot call keeps the Python wrapper
and a warning says why and what to change. Before, the setting never reached them and nothing
said so. On 2 gloo ranks: ``tests/test_parity.py`` (the ``cpp_wrapper`` variant).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import graphshard
from graphshard.compiler import wrapper_choice
from graphshard.compiler.wrapper_choice import cpp_wrapper_blockers
from graphshard.models.llama import Llama, LlamaConfig

_CPP = "inductor_entry_impl"  # the C++ wrapper's entry point, in its generated source


def _llama(**shard_options) -> nn.Module:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, ffn_hidden=48, max_seq_len=8))
    model.init_weights(0)
    return graphshard.shard(model, **shard_options)


def _train(model: nn.Module, cpp_wrapper: bool) -> tuple[list[torch.Tensor], list[str]]:
    """Two SGD steps of ``model`` compiled by graphshard, Inductor's caches off so that every
    graph is generated here: the losses and the generated wrappers' sources."""
    run = torch.compile(model, backend=graphshard.backend())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def steps() -> list[torch.Tensor]:
        losses = []
        for step in range(2):
            tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
            loss = run(tokens, tokens).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses

    with functorch_config.patch(enable_autograd_cache=False), \
            inductor_config.patch(fx_graph_cache=False, cpp_wrapper=cpp_wrapper):
        return run_and_get_code(steps)


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def _assert_same_training(model, losses, reference, reference_losses) -> None:
    assert torch.equal(torch.stack(losses), torch.stack(reference_losses))
    for name, value in _full_state(reference).items():
        torch.testing.assert_close(_full_state(model)[name], value, rtol=0, atol=0, msg=name)


def test_graphs_torch_can_wrap_in_cpp_are_wrapped_in_cpp_and_train_alike(one_rank):
    reference = _llama(compile_blocks_once=False)
    reference_losses, python_code = _train(reference, cpp_wrapper=False)
    assert len(python_code) == 2 and not any(_CPP in code for code in python_code)
    model = _llama(compile_blocks_once=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", graphshard.PythonWrapperWarning)
        losses, code = _train(model, cpp_wrapper=True)
    assert len(code) == 2 and all(_CPP in c for c in code)  # forward and backward
    _assert_same_training(model, losses, reference, reference_losses)


def _assert_python_wrapped_with_a_warning(match: str) -> None:
    """The default Llama (blocks as compile regions) compiled with ``cpp_wrapper`` on warns
    ``match``, keeps the Python wrapper for both graphs and trains as with it off."""
    reference = _llama()
    reference_losses, _ = _train(reference, cpp_wrapper=False)
    model = _llama()
    with pytest.warns(graphshard.PythonWrapperWarning, match=match):
        losses, code = _train(model, cpp_wrapper=True)
    assert len(code) == 2 and not any(_CPP in c for c in code)
    _assert_same_training(model, losses, reference, reference_losses)


def test_compile_regions_keep_the_python_wrapper_and_the_warning_says_what_to_change(one_rank):
    _assert_python_wrapped_with_a_warning(
        r"cpp_wrapper is set.*compile region.*compile_blocks_once=False")


def test_a_refusal_not_foreseen_is_compiled_again_with_the_python_wrapper(one_rank, monkeypatch):
    """Where torch's C++ wrapper refuses an operation graphshard does not know of, the graph
    is compiled again with the Python wrapper, and the warning quotes torch."""
    monkeypatch.setattr(wrapper_choice, "_known_blockers", dict)
    _assert_python_wrapped_with_a_warning(r"C\+\+ wrapper refused this graph .*invoke_subgraph")


@pytest.mark.parametrize("error", [RuntimeError("g++ failed"),
                                   NotImplementedError("no rule for this cpp wrapper op")],
                         ids=["compiler", "not-implemented-elsewhere"])
def test_other_errors_of_a_cpp_wrapped_compile_are_raised_as_they_are(one_rank, monkeypatch,
                                                                      error):
    """A C++-wrapped compile that fails for another reason (made-up errors: a compiler's,
    and a ``NotImplementedError`` raised outside Inductor's C++ wrapper code generation) is
    not retried with the Python wrapper: the error is the user's to see."""
    from torch._inductor import compile_fx

    real = compile_fx.compile_fx_inner

    def failing(gm, example_inputs, **kwargs):
        if kwargs.get("cpp_wrapper"):
            raise error
        return real(gm, example_inputs, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", failing)
    run = torch.compile(_llama(compile_blocks_once=False), backend=graphshard.backend())
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with inductor_config.patch(cpp_wrapper=True), \
            warnings.catch_warnings(record=True) as caught, \
            pytest.raises(Exception, match=re.escape(str(error))):
        warnings.simplefilter("always")
        run(tokens, tokens)
    assert not [w for w in caught if issubclass(w.category, graphshard.PythonWrapperWarning)]


def test_gloos_all_to_all_is_named_as_a_blocker(fake2):
    backend = graphshard.backend(inductor=False, reduce_scatter_via="all_to_all")
    tokens = torch.randint(0, 64, (2, 8))
    torch.compile(_llama(compile_blocks_once=False), backend=backend)(tokens, tokens) \
        .loss.backward()
    (stages,) = backend.graphs
    assert cpp_wrapper_blockers(stages["fw"]) == []
    (reason,) = cpp_wrapper_blockers(stages["bw"])
    assert "all_to_all_single" in reason and "reduce_scatter_via='reduce_scatter'" in reason
