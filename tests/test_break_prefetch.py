"""``backend(break_prefetch=True)``: across a graph break, the end of one forward graph
gathers what the next one starts with (``graphshard.api.break_prefetch``).

One launch of 2 gloo ranks: the tiny Llama with a graph break before its final norm (Dynamo
then compiles three graphs: up to the norm, the norm, the output layer), trained with the
feature on and off, through graphshard's passes alone and through Inductor."""

from __future__ import annotations

import pytest
import torch
from break_prefetch_jobs import EDIT_STEP, STEPS, reference, run_jobs
from dist_utils import run_ranks
from parity import assert_matches

from graphshard.passes.markers import PREFETCH_BY_BREAK

ON, OFF = (True, "lowered", "plain"), (False, "lowered", "plain")
INDUCTOR = (True, "inductor", "plain")
EVAL = (True, "lowered", "eval")
EDIT = (True, "lowered", "edit")
JOBS = [ON, OFF, INDUCTOR, EVAL, EDIT]
LED = 2  # graphs that follow a break and start by gathering (the norm's, the output's)


@pytest.fixture(scope="module")
def world2():
    return run_ranks(run_jobs, 2, JOBS)


@pytest.mark.parametrize("job", [ON, OFF, INDUCTOR, EVAL], ids=lambda j: "-".join(map(str, j)))
def test_trains_like_one_process(world2, job):
    expected = reference(2)
    for rank in world2:
        assert_matches(rank[job], expected)


def test_on_is_bit_identical_to_off(world2):
    for rank in world2:
        assert rank[ON]["losses"] == rank[OFF]["losses"]
        for key, value in rank[OFF]["state"].items():
            assert torch.equal(rank[ON]["state"][key], value), key


@pytest.mark.parametrize("job", [ON, INDUCTOR], ids=["lowered", "inductor"])
def test_the_next_graphs_gathers_are_in_flight_at_the_break(world2, job):
    """From the second step on, when the eager code at the break runs, the gather of the
    norm (the next graph's first) is already issued; each graph after a break takes its
    gather from the graph before; none is left over."""
    for rank in world2:
        result = rank[job]
        assert result["seen_pending"] == [0] + [1] * (STEPS - 1)
        stats = result["stats"]
        assert stats["issued"] == stats["taken"] == LED * (STEPS - 1)
        assert stats["stale"] == 0 and stats["split_steps"] == 0
        assert result["left"] == 0
        # each graph's leading gathers are bound, for a break only (not the step)
        assert [set(b) for b in result["bound"]] == [{PREFETCH_BY_BREAK}] * 3
        off = rank[OFF]
        assert off["seen_pending"] == [0] * STEPS and off["bound"] == [[], [], []]
        assert off["stats"] == dict.fromkeys(stats, 0)


def test_an_evaluation_forward_between_steps_changes_nothing(world2):
    """An evaluation forward under ``no_grad`` after each step (its own graphs, which bind
    no gather) neither issues nor takes: the training forwards prefetch as without it, and
    nothing is left pending after it."""
    for rank in world2:
        assert rank[EVAL]["stats"] == rank[ON]["stats"]
        assert rank[EVAL]["left"] == 0


def test_a_shard_changed_between_the_graphs_raises(world2):
    for rank in world2:
        result = rank[EDIT]
        assert len(result["losses"]) == EDIT_STEP
        assert "changed between two graphs of one forward" in result["error"]
        assert "break_prefetch" in result["error"]
        assert result["left"] == 0
