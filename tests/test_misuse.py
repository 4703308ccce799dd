"""Misuse that used to train silently wrong: each must raise with the fix, before any step."""

from __future__ import annotations

import pytest
import torch
from graph_utils import TwoBlock, exception_chain, fake_process_group
from torch import nn
from torch.distributed.tensor import DTensor

import graphshard
from graphshard.api.sharding import shard_state
from graphshard.errors import ShardedModelError
from graphshard.safety import plain_params


def _compile_step(model: nn.Module) -> None:
    compiled = torch.compile(model, backend=graphshard.backend(inductor=False), fullgraph=True)
    compiled(torch.randn(4, 8)).sum().backward()


def _raised(error: pytest.ExceptionInfo, kind: type) -> BaseException:
    """The graphshard error itself: Dynamo wraps what a backend raises (``BackendCompilerFailed``,
    whose ``inner_exception`` it is)."""
    found = [e for e in exception_chain(error.value) if isinstance(e, kind)]
    assert found, f"no {kind.__name__} in the chain of {error.value!r}"
    return found[0]


def test_compiling_a_model_that_was_never_sharded_on_two_ranks_says_to_shard_it():
    with fake_process_group(2):
        with pytest.raises(Exception) as error:
            _compile_step(TwoBlock())
    message = str(_raised(error, ShardedModelError))
    assert "not sharded" in message and "on 2 ranks" in message
    assert "graphshard.shard(model)" in message


def test_a_model_sharded_only_in_part_is_refused_too():
    with fake_process_group(2):
        model = TwoBlock()
        graphshard.shard(model.blocks[0])  # the other block and the head stay plain
        with pytest.raises(Exception) as error:
            _compile_step(model)
    assert "trainable parameter(s) that are not sharded" in str(_raised(error,
                                                                        ShardedModelError))


def test_frozen_plain_parameters_and_world_1_compile():
    with fake_process_group(2):
        model = TwoBlock()
        frozen = nn.Linear(8, 8)
        frozen.requires_grad_(False)
        graphshard.shard(model)
        model.frozen = frozen  # not trained: nothing to synchronise
        _compile_step(model)
    with fake_process_group(1):  # one rank: the plain model compiles and trains
        model = TwoBlock()
        _compile_step(model)
        assert all(p.grad is not None for p in model.parameters())


def test_a_layer_replaced_after_shard_is_refused_at_the_next_eager_forward():
    """``model.head = nn.Linear(...)`` after ``shard()`` (a new classifier for fine-tuning):
    its plain parameters' gradients are never synchronised, and each rank trained its own
    head. The next eager forward says to replace before sharding; frozen, it runs."""
    with fake_process_group(2):
        model = graphshard.shard(TwoBlock())
        model(torch.randn(4, 8))  # checked once: nothing plain
        model.head = nn.Linear(8, 3)
        for _ in range(2):  # refused at every forward until fixed
            with pytest.raises(ShardedModelError,
                               match=r"not sharded: 'head.weight', 'head.bias', added after "
                                     r"graphshard.shard\(\).*before graphshard.shard\(model\)"):
                model(torch.randn(4, 8))
        model.head.requires_grad_(False)
        model(torch.randn(4, 8))
    with fake_process_group(1):  # one rank: nothing to synchronise
        model = graphshard.shard(TwoBlock())
        model.head = nn.Linear(8, 3)
        model(torch.randn(4, 8))


def test_a_forward_that_slices_its_layer_list_counts_no_new_layer():
    """Hugging Face's Llama slices its ``ModuleList`` at every forward, which registers the
    (sharded) layers with a new list: not a new plain parameter, so the eager check above
    does not walk the model again at every step."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, use_cache=False)
    with fake_process_group(2):
        model = graphshard.shard(transformers.LlamaForCausalLM(config))
        tokens = torch.randint(0, 32, (2, 8))
        model(tokens)
        counted = plain_params._REGISTRATIONS[0]
        model(tokens)
        assert plain_params._REGISTRATIONS[0] == counted
        model.lm_head = nn.Linear(16, 32, bias=False)  # a new plain layer is counted
        assert plain_params._REGISTRATIONS[0] > counted


def test_importing_graphshard_installs_no_registration_hook_until_a_model_is_sharded():
    """The new-layer check's hooks on torch's module and parameter registration, and the
    optimizer step hooks (the guard's pre-hook; ``optimizer_steps``' pre- and post-hook;
    ``optimizer_state``'s pre-hook), are installed once, by the first ``shard()``, not by
    ``import graphshard``."""
    import subprocess
    import sys

    code = ("import graphshard, torch.nn.modules.module as m\n"
            "from torch.optim.optimizer import _global_optimizer_pre_hooks as pre\n"
            "from torch.optim.optimizer import _global_optimizer_post_hooks as post\n"
            "assert not m._global_module_registration_hooks\n"
            "assert not m._global_parameter_registration_hooks\n"
            "assert not pre and not post, (pre, post)\n"
            "from graph_utils import TwoBlock, fake_process_group\n"
            "with fake_process_group(2):\n"
            "    graphshard.shard(TwoBlock())\n"
            "    graphshard.shard(TwoBlock())\n"
            "assert len(m._global_module_registration_hooks) == 1\n"
            "assert len(m._global_parameter_registration_hooks) == 1\n"
            "assert len(pre) == 3 and len(post) == 1, (pre, post)\n")
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tests_dir)


class ClampsInForward(nn.Module):
    """Updates a parameter in place inside forward (the gathered copy, under graphshard)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            self.a.weight.clamp_(-0.05, 0.05)
        return self.b(self.a(x))


def test_an_in_place_update_of_a_parameter_inside_forward_is_refused_compiled():
    with fake_process_group(2):
        model = graphshard.shard(ClampsInForward())
        with pytest.raises(Exception) as error:
            _compile_step(model)
    message = str(_raised(error, ShardedModelError))
    assert "In-place clamp_ on parameter 'a.weight' inside forward" in message
    assert "self.a.weight.clamp_(-0.05, 0.05)" in message  # the user's line
    assert "outside forward" in message
    assert "model.a.weight.clamp_(...)" in message


def test_an_in_place_update_of_a_parameter_inside_forward_is_refused_eagerly():
    with fake_process_group(2):
        model = graphshard.shard(ClampsInForward())
        with pytest.raises(ShardedModelError, match="on parameter 'a.weight' inside forward"):
            model(torch.randn(4, 8))  # caught at the next read, before the update is used


class RenormingEmbedding(nn.Module):
    """``nn.Embedding(max_norm=...)``: torch renormalises the looked-up rows of the weight in
    place inside ``F.embedding``, where no in-place call of the model's own shows."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8, max_norm=1.0)
        self.head = nn.Linear(8, 32)

    def forward(self, ids):
        return self.head(self.emb(ids))


def _ids() -> torch.Tensor:
    return torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(0))


def test_an_update_inside_a_torch_function_is_refused_compiled():
    """Found by the gathered copy's version counter (compiled, it trained silently wrong:
    the renormalised rows never reached the shards)."""
    with fake_process_group(2):
        model = graphshard.shard(RenormingEmbedding())
        compiled = torch.compile(model, backend=graphshard.backend(inductor=False))
        with pytest.raises(Exception) as error:
            compiled(_ids())
    message = str(_raised(error, ShardedModelError))
    assert "In-place update on parameter 'emb.weight' inside forward" in message
    assert "return self.head(self.emb(ids))" in message  # the user's line, not graphshard's
    assert "nn.Embedding(max_norm=...)" in message and "torch.renorm" in message


def test_an_update_inside_a_torch_function_is_refused_eagerly_and_the_recipe_runs():
    """Eagerly autograd refuses the update of the gathered copy (a view) naming no
    parameter; graphshard's error names it and keeps autograd's as the cause. The model
    trains after the change the message gives."""
    with fake_process_group(2):
        model = graphshard.shard(RenormingEmbedding())
        with pytest.raises(ShardedModelError, match="update on parameter 'emb.weight'") as error:
            model(_ids())
        assert isinstance(error.value.__cause__, RuntimeError)
        state = shard_state(model)
        assert state.eager_gathered == {} and state.eager_reads == []
        model.emb.max_norm = None
        model(_ids()).sum().backward()
        with torch.no_grad():  # the message's recipe, on this rank's rows
            w = model.emb.weight.to_local()
            w.copy_(torch.renorm(w, 2, 0, 1.0))
        assert float(model.emb.weight.to_local().detach().norm(dim=1).max()) <= 1.0 + 1e-6


def _grads_follow_placements(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        assert isinstance(param.grad, DTensor), name
        assert param.grad.placements == param.placements and param.grad.shape == param.shape


def test_updating_the_sharded_parameter_outside_forward_is_fine():
    with fake_process_group(2):
        model = graphshard.shard(ClampsInForward())
        model.forward = lambda x: model.b(model.a(x))  # no update inside forward
        rows = model.a.weight.to_local().detach().clone()
        with torch.no_grad():
            model.a.weight.clamp_(-0.05, 0.05)  # the sharded DTensor itself
        assert torch.equal(model.a.weight.to_local(), rows.clamp(-0.05, 0.05))
        _compile_step(model)
        model(torch.randn(4, 8)).sum().backward()
        _grads_follow_placements(model)


def test_a_parametrization_registered_after_shard_says_to_register_it_before():
    """``register_parametrization`` deletes the parameter it wraps: after ``shard()`` that is
    refused, and the error names the order that works (parametrize, then shard)."""
    import torch.nn.utils.parametrize as parametrize

    class Halved(nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight / 2

    with fake_process_group(2):
        model = graphshard.shard(TwoBlock())
        with pytest.raises(ShardedModelError, match="register_parametrization.*before shard"):
            parametrize.register_parametrization(model.blocks[0].up, "weight", Halved())
        assert isinstance(model.blocks[0].up.weight, DTensor)  # left as it was
        plain = TwoBlock()
        parametrize.register_parametrization(plain.blocks[0].up, "weight", Halved())
        _compile_step(graphshard.shard(plain))


@pytest.mark.parametrize("value", ["dtensor", "plain"])
def test_assigning_a_sharded_parameters_data_is_refused_at_the_next_forward_and_step(value):
    """``param.data = ...`` leaves a DTensor's local shard as it was (torch's DTensor and
    FSDP2 ignore it with no error): the eager forward and the optimizer step refuse it; a
    compiled forward reads the shards and is refused at the step."""
    with fake_process_group(2):
        model = graphshard.shard(TwoBlock())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        weight = model.blocks[0].up.weight
        with torch.no_grad():
            weight.data = weight.data * 0.5 if value == "dtensor" else torch.zeros(12, 8)
        with pytest.raises(ShardedModelError, match=r"'blocks.0.up.weight'.*param.data = "):
            model(torch.randn(4, 8))
        _compile_step(model)
        with pytest.raises(ShardedModelError, match=r"in place under torch.no_grad"):
            opt.step()


def test_in_place_updates_and_conversions_of_sharded_parameters_are_not_taken_for_it():
    with fake_process_group(2):
        model = graphshard.shard(TwoBlock())
        up, head = (p.to_local().detach().clone()
                    for p in (model.blocks[0].up.weight, model.head.weight))
        with torch.no_grad():
            model.blocks[0].up.weight.mul_(0.5)
            model.head.weight.copy_(model.head.weight * 2)
        assert torch.equal(model.blocks[0].up.weight.to_local(), up * 0.5)
        assert torch.equal(model.head.weight.to_local(), head * 2)
        model.double()  # graphshard follows the swapped shards
        assert model.head.weight.dtype == torch.float64
        assert shard_state(model).params[0].param is next(model.parameters())
        model.float()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 8)).sum().backward()
        _grads_follow_placements(model)
        opt.step()
        meta = graphshard.shard(TwoBlock().to("meta"))
        meta.to_empty(device="cpu")
        assert not any(p.is_meta or p.to_local().is_meta for p in meta.parameters())
        meta(torch.randn(4, 8)).sum().backward()
        _grads_follow_placements(meta)
        torch.optim.SGD(meta.parameters(), lr=0.1).step()


def test_a_deep_copy_of_a_sharded_model_says_how_to_get_one():
    import copy

    with fake_process_group(2):
        model = graphshard.shard(TwoBlock())
        for target in (model, model.blocks[0], model.head):
            with pytest.raises(ShardedModelError, match="Copy the model before sharding it"):
                copy.deepcopy(target)
        plain = TwoBlock()
        twin = copy.deepcopy(plain)  # an unsharded model copies as before
        graphshard.shard(twin)
        assert type(plain).__name__ == "TwoBlock"


def test_an_averaged_model_made_before_shard_averages_the_shards(one_rank):
    """The recipe the deep-copy error gives for an EMA: ``AveragedModel(model)`` before
    ``shard()``, then shard the model and ``ema.module``; ``update_parameters`` (torch's
    foreach lerp on the shards) and the EMA's forward give the unsharded EMA's values."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    runs = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = TwoBlock()
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8))
        if sharded:
            graphshard.shard(model)
            graphshard.shard(ema.module)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            model(torch.randn(4, 8, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ema.update_parameters(model)
        with torch.no_grad():
            out = ema(torch.randn(4, 8, generator=gen))
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v
                 for k, v in ema.module.state_dict().items()}
        runs.append((state, out))
    (want, want_out), (got, got_out) = runs
    torch.testing.assert_close(got_out, want_out)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=key)


class _Holder(nn.Module):
    """A root without parameters of its own: ``share_memory()`` reaches the sharded modules
    through ``_apply``'s recursion only."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = TwoBlock()


@pytest.mark.parametrize("root", [TwoBlock, _Holder])
def test_share_memory_of_a_sharded_model_is_refused_instead_of_crashing(root):
    """torch's ``Tensor.share_memory_()`` of a DTensor kills the process (SIGSEGV, torch 2.11
    to 2.14): the sharded modules refuse it first, from the root or from a submodule."""
    with fake_process_group(2):
        model = graphshard.shard(root())
        sharded = model if root is TwoBlock else model.inner
        for target in (model, sharded.blocks[0]):
            with pytest.raises(ShardedModelError, match="StateDictOptions"):
                target.share_memory()
        plain = TwoBlock().share_memory()  # an unsharded model shares as before
        assert all(p.is_shared() for p in plain.parameters())


def test_pickling_a_sharded_model_says_what_to_save_instead(tmp_path):
    """``torch.save(model)`` pickles the module itself: refused with the state-dict recipes
    (torch's own error named one of graphshard's forward hooks)."""
    import pickle

    with fake_process_group(2):
        model = graphshard.shard(TwoBlock())
        for target in (model, model.blocks[0]):
            with pytest.raises(ShardedModelError, match="get_model_state_dict"):
                torch.save(target, tmp_path / "model.pt")
            with pytest.raises(ShardedModelError, match="StateDictOptions"):
                pickle.dumps(target)
        torch.save(TwoBlock(), tmp_path / "plain.pt")  # an unsharded model pickles as before
        torch.save(model.state_dict(), tmp_path / "state.pt")  # and the sharded state


def test_pruning_after_shard_says_to_prune_before():
    """``torch.nn.utils.prune`` re-registers the weight as ``weight_orig``: after ``shard()``
    that is refused, naming prune and the order that works; pruned before, the model shards
    and compiles."""
    import torch.nn.utils.prune as prune

    with fake_process_group(2):
        model = graphshard.shard(TwoBlock())
        with pytest.raises(ShardedModelError, match="torch.nn.utils.prune .*before shard"):
            prune.l1_unstructured(model.blocks[0].up, "weight", 0.3)
        assert isinstance(model.blocks[0].up.weight, DTensor)  # left as it was
        plain = TwoBlock()
        prune.l1_unstructured(plain.blocks[0].up, "weight", 0.3)
        _compile_step(graphshard.shard(plain))


@pytest.mark.parametrize("strict", [False, True])
def test_exporting_a_sharded_model_says_what_to_export_instead(strict):
    """``torch.export`` swaps its inputs into the parameters' places as functional_call does;
    on a sharded model it failed inside DTensor with the parameter's repr (non-strict), or
    captured graphshard's gathers with this rank's shards as detached constants (strict).
    Both are refused, naming what to export; the plain model exports as before."""
    x = torch.randn(4, 8)
    with fake_process_group(2):
        model = graphshard.shard(TwoBlock())
        with pytest.raises(Exception) as error:
            torch.export.export(model, (x,), strict=strict)
        # strict: Dynamo's error quotes graphshard's
        assert "torch.export cannot capture a sharded model" in str(error.value)
        assert "Export the model before graphshard.shard()" in str(error.value)
    plain = TwoBlock()
    torch.testing.assert_close(torch.export.export(plain, (x,), strict=strict).module()(x),
                               plain(x))
