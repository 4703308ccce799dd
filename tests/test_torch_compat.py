"""graphshard on every supported torch (``graphshard.MIN_TORCH`` through 2.14): each torch
name the library and the bench import or call through ``dist.`` exists in the torch running the
tests, imports inside function bodies included (those fail only when their feature runs), and
the step prefetch gathers through the API this torch has."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from graphshard.safety import gloo_gather

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "graphshard", ROOT / "passes", ROOT / "bench"]


def _sources() -> list[Path]:
    return sorted(p for folder in SOURCES for p in folder.rglob("*.py"))


def _torch_imports() -> set[tuple[str, str | None]]:
    """``(module, name)`` for each ``from torch... import name``, ``(module, None)`` for each
    ``import torch...``, anywhere in the sources."""
    found: set[tuple[str, str | None]] = set()
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module == "torch" or node.module.startswith("torch.")):
                found.update((node.module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update((alias.name, None) for alias in node.names
                             if alias.name == "torch" or alias.name.startswith("torch."))
    return found


def _dist_attributes() -> set[str]:
    """Every ``dist.<name>`` the sources read (``import torch.distributed as dist``)."""
    names = set()
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "dist"):
                names.add(node.attr)
    return names


def test_the_sources_are_found():
    imports = _torch_imports()
    assert ("torch._inductor.compile_fx", "compile_fx_inner") in imports  # in a function body
    assert "init_process_group" in _dist_attributes()


def test_every_torch_import_exists_in_this_torch():
    missing = []
    for module, name in sorted(_torch_imports(), key=str):
        try:
            imported = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"import {module} ({exc})")
            continue
        if name is not None and not hasattr(imported, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                missing.append(f"from {module} import {name}")
    assert not missing, f"torch {torch.__version__} lacks: {missing}"


def test_every_dist_function_called_exists_in_this_torch():
    missing = sorted(name for name in _dist_attributes() if not hasattr(dist, name))
    assert not missing, f"torch {torch.__version__} lacks torch.distributed.{missing}"


def test_step_prefetch_gathers_with_the_api_this_torch_has():
    if hasattr(dist, "all_gather_single"):  # torch 2.13 on
        assert gloo_gather.all_gather_single is dist.all_gather_single
    else:  # torch 2.11
        assert gloo_gather.all_gather_single is dist.all_gather_into_tensor


def test_the_step_prefetch_gather_runs_async_without_a_deprecation_warning(one_rank):
    sent = torch.arange(6, dtype=torch.float32)
    gathered = sent.new_empty(6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        work = gloo_gather.all_gather_single(gathered, sent, one_rank, async_op=True)
    work.wait()
    assert torch.equal(gathered, sent)


def test_odd_mlp_trains_in_bf16_against_fp32_targets():
    """A bf16 output against fp32 targets: torch 2.11's mse_loss backward fails on the mixed
    dtypes, so OddMLP computes the loss in the promoted dtype (the value mse_loss gives)."""
    from graphshard.models.mlp import OddMLP

    torch.manual_seed(0)
    model = OddMLP().to(torch.bfloat16)
    x, y = torch.randn(4, 13, dtype=torch.bfloat16), torch.randn(4, 3)
    loss = model(x, y).loss
    assert loss.dtype == torch.float32
    assert torch.equal(loss, ((model(x).output.float() - y) ** 2).mean())
    loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16
               for p in model.parameters())


def test_aot_cache_on_a_torch_whose_cache_refuses_to_local_raises_naming_the_version(
        monkeypatch):
    import graphshard
    from graphshard._torch_version import installed_torch_version
    from graphshard.compiler import backend, cache_key
    from graphshard.errors import GraphshardNotImplementedError

    supported = cache_key.aot_cache_unsupported() is None
    known = {(2, 11): False, (2, 13): True, (2, 14): True}  # as checked on each
    assert known.get(installed_torch_version(), supported) == supported
    if supported:
        graphshard.backend(aot_cache=True)
        monkeypatch.setattr(backend, "aot_cache_unsupported",
                            lambda: "aot_cache=True needs torch 2.13 or newer")
    with pytest.raises(GraphshardNotImplementedError, match=r"aot_cache=True needs .*2\.13"):
        graphshard.backend(aot_cache=True)
    graphshard.backend(aot_cache=False)  # the default still works
