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
from graph_utils import Breaks, calls
from parity import assert_matches

import graphshard
from graphshard.compiler.graph_breaks import GraphBreakWarning
from graphshard.passes.markers import PREFETCH_BY_BREAK, PREFETCH_BY_STEP, TAKE_PREFETCHED

ON, OFF = (True, "lowered", "plain"), (False, "lowered", "plain")
INDUCTOR = (True, "inductor", "plain")
EVAL = (True, "lowered", "eval")
EDIT = (True, "lowered", "edit")
WITH_STEP = (True, "lowered", "with_step")
JOBS = [ON, OFF, INDUCTOR, EVAL, EDIT, WITH_STEP]
LED = 2  # graphs that follow a break and start by gathering (the norm's, the output's)


@pytest.fixture(scope="module")
def world2():
    return run_ranks(run_jobs, 2, JOBS)


@pytest.mark.parametrize("job", [ON, OFF, INDUCTOR, EVAL, WITH_STEP],
                         ids=lambda j: "-".join(map(str, j)))
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


def test_with_step_prefetch_the_step_gathers_the_first_graphs_buckets(world2):
    """Both options: the optimizer step issues the first graph's leading gathers (checked
    by the ranks together), the end of each graph the next one's; all are taken, and the
    numbers are those of both off, bit for bit."""
    for rank in world2:
        result = rank[WITH_STEP]
        first, *after = [set(b) for b in result["bound"]]
        assert first == {PREFETCH_BY_BREAK | PREFETCH_BY_STEP}
        assert after == [{PREFETCH_BY_BREAK | PREFETCH_BY_STEP}] * LED
        stats = result["stats"]
        led_first = len(result["bound"][0])
        assert stats["taken"] == (LED + led_first) * (STEPS - 1)
        # every step issues the first graph's (the last one's are never taken)
        assert stats["issued"] == LED * (STEPS - 1) + led_first * STEPS
        assert stats["stale"] == 0 and stats["split_steps"] == STEPS
        assert result["seen_pending"] == [0] + [1] * (STEPS - 1)
        assert result["losses"] == rank[OFF]["losses"]
        for key, value in rank[OFF]["state"].items():
            assert torch.equal(result["state"][key], value), key


def test_a_shard_changed_between_the_graphs_raises(world2):
    for rank in world2:
        result = rank[EDIT]
        assert len(result["losses"]) == EDIT_STEP
        assert "the local shard of parameter 'norm.weight' changed after" in result["error"]
        assert "break_prefetch" in result["error"]
        assert result["left"] == 0


def test_a_bucket_of_several_parameters_is_bound_and_taken(fake2):
    """Block 1's bucket (four parameters, gathered from one flat buffer of their pieces)
    and the head's, gathered before block 1 computes, lead the second graph: bound for a
    break, issued at the first graph's end from the second step on, taken there."""
    from graphshard.api import step_prefetch

    backend = graphshard.backend(inductor=False, break_prefetch=True)
    model = graphshard.shard(Breaks())
    run = torch.compile(model, backend=backend)
    step_prefetch.reset_stats()
    with pytest.warns(GraphBreakWarning, match="unless break_prefetch, which issues it at"):
        for _ in range(3):
            run(torch.randn(4, 8)).sum().backward()
    first, second = (calls(stages["fw"], TAKE_PREFETCHED) for stages in backend.graphs)
    assert len(first) == 1 and len(second) == 2
    assert {take.kwargs["sources"] for take in first + second} == {PREFETCH_BY_BREAK}
    for take, module in zip(second, (model.blocks[1], model.head), strict=True):
        assert [s.meta["val"].shape for s in take.kwargs["shards"]] == [
            p.to_local().shape for p in module.parameters()]
    assert step_prefetch.stats()["taken"] == step_prefetch.stats()["issued"] == 2 * 2


def test_the_warning_of_a_break_suggests_it(fake2):
    model = graphshard.shard(Breaks())
    with pytest.warns(GraphBreakWarning, match=r"or pass graphshard.backend\(break_prefetch="):
        torch.compile(model, backend=graphshard.backend(inductor=False))(torch.randn(4, 8))
