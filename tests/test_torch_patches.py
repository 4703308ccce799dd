"""graphshard's fixes of torch bugs (graphshard/safety/torch_patch.py) patch torch exactly on
the releases they are for, once per process, and tag the FX-graph cache keys of the compiles
they apply to. The 2.11 bugs themselves: tests/test_norm_pool_head.py,
tests/test_row_updates.py; the region fixes: tests/test_region_*.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphshard
from graphshard._torch_version import installed_torch_version
from graphshard.safety.fusion_deps import FUSION_KEEPS_ORDERING_DEPS
from graphshard.safety.masked_vec import MASKED_RESULTS_STAY_SCALAR
from graphshard.safety.torch_patch import TorchPatch


def _patched_functions():
    from torch._inductor.codegen.cpp import CppVecOverrides
    from torch._inductor.scheduler import SchedulerNode

    return {"fusion_deps": (FUSION_KEEPS_ORDERING_DEPS, SchedulerNode.recompute_size_and_body),
            "masked_vec": (MASKED_RESULTS_STAY_SCALAR, CppVecOverrides.masked)}


def test_after_a_compile_torch_is_patched_only_where_a_fix_is_needed(one_rank):
    model = graphshard.shard(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)))
    torch.compile(model, backend=graphshard.backend())(torch.randn(3, 4)).sum().backward()
    for name, (patch, function) in _patched_functions().items():
        needed = installed_torch_version() in patch.releases
        assert patch.needed() == needed
        assert hasattr(function, "torch_original") == needed, name


def _counting_patch(releases):
    calls = []
    return TorchPatch(lambda: calls.append(1), cache_tag="test:tag",
                      releases=frozenset(releases)), calls


def test_a_patch_applies_once_and_tags_cache_keys_where_needed():
    from torch.compiler import config

    patch, calls = _counting_patch({installed_torch_version()})
    before = config.cache_key_tag
    with patch.applied():
        assert "test:tag" in config.cache_key_tag
        with patch.applied():
            pass
    patch.apply_in_this_process()
    assert calls == [1]
    assert config.cache_key_tag == before


@pytest.mark.parametrize("release", [(2, 0), (9, 99)])
def test_a_patch_for_another_release_changes_nothing(release):
    from torch.compiler import config

    patch, calls = _counting_patch({release})
    before = config.cache_key_tag
    with patch.applied():
        assert config.cache_key_tag == before
    assert calls == []


def test_a_patch_for_every_release_without_a_tag_applies_once_and_tags_nothing():
    from torch.compiler import config

    calls = []
    patch = TorchPatch(lambda: calls.append(1))
    before = config.cache_key_tag
    with patch.applied():
        assert config.cache_key_tag == before
    patch.apply_in_this_process()
    assert patch.needed()
    assert calls == [1]
