"""The suite's rank launcher (``dist_utils``): ranks fork from one server per test process,
yet each launch runs in the launching test's environment."""

from __future__ import annotations

import os

from dist_utils import run_ranks

_VAR = "GRAPHSHARD_TEST_LAUNCH_ENV"


def _seen(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    return {"value": os.environ.get(_VAR), "parent": os.getppid(), "rank": dist.get_rank(),
            "world": dist.get_world_size()}


def test_ranks_fork_from_the_server_in_the_launching_tests_environment(monkeypatch):
    monkeypatch.setenv(_VAR, "first")
    first = run_ranks(_seen, 2)
    monkeypatch.setenv(_VAR, "second")  # the server started during the first launch
    second = run_ranks(_seen, 2)
    monkeypatch.delenv(_VAR)
    third = run_ranks(_seen, 1)
    assert [r["value"] for r in first] == ["first", "first"]
    assert [r["value"] for r in second] == ["second", "second"]
    assert third[0]["value"] is None
    assert [(r["rank"], r["world"]) for r in second] == [(0, 2), (1, 2)]
    # every rank's parent is the one fork server, not this process
    parents = {r["parent"] for r in first + second + third}
    assert len(parents) == 1 and os.getpid() not in parents
