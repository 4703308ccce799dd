"""The suite's rank launcher (``dist_utils``): ranks fork from one server per test process,
yet each launch runs in the launching test's environment."""

from __future__ import annotations

import os

import pytest
from dist_utils import RankCrashed, crash_summary, run_ranks

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


def _inherited(rank: int, world_size: int) -> dict:
    import sys

    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return {"warmed": "rank_warmup" in sys.modules,
            "probed": valid_vec_isa_list.cache_info().currsize}


def test_ranks_inherit_the_vector_isa_probe_from_the_server():
    """``rank_warmup`` ran in the fork server (its import failing there would be silent:
    the server skips a preload it cannot import), so a rank starts with Inductor's probe of
    the CPU's vector instruction sets done and compiles without running it again."""
    for seen in run_ranks(_inherited, 2):
        assert seen == {"warmed": True, "probed": 1}


def _abort_on_rank_1(rank: int, world_size: int) -> None:
    import sys

    sys.stderr.write("[rank1]:W1203 a logged warning, not the reason\n")
    if rank == 1:
        os.write(2, b"malloc(): a native message the rank printed before dying\n")
        os.abort()


def test_a_rank_killed_by_a_signal_reports_the_end_of_its_stderr(capfd):
    """A rank that dies by a signal has no Python traceback: the error names the signal and
    carries the native message and the crashing Python frame (faulthandler's stack)."""
    with pytest.raises(RankCrashed) as raised:
        run_ranks(_abort_on_rank_1, 2)
    first_line = str(raised.value).splitlines()[0]
    assert first_line.startswith("rank 1 of 2 died with SIGABRT: malloc(): a native message")
    assert "Fatal Python error: Aborted" in first_line
    assert "in _abort_on_rank_1" in first_line
    assert "a logged warning" not in first_line
    # what every rank wrote still reaches the test's captured stderr
    assert capfd.readouterr().err.count("a logged warning, not the reason") == 2


def test_the_crash_summary_of_a_rank_that_raised_or_printed_no_fatal_error():
    raised = ("[rank0]:W1203 a warning\nTraceback (most recent call last):\n"
              '  File "x.py", line 1, in f\n    g()\n'
              "RuntimeError: Connection closed by peer\n  more of the message\n")
    assert crash_summary(raised) == "RuntimeError: Connection closed by peer"
    assert crash_summary("first\nlast words\n\n") == "last words"
    assert crash_summary("") == "(nothing on stderr)"
