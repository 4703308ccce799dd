"""The pass runner: lint and recompile once per pass, invariants between passes, timings.

Each broken pass below is a small hand-made graph edit applied to a real lowered graph; the
runner must name the pass and the node."""

from __future__ import annotations

import pytest
import torch
from graph_utils import MATMULS, BlockStack, c10d, calls, fake_process_group
from torch import fx

import graphshard
from graphshard.passes import Plan, lower_unshard
from graphshard.passes.markers import is_unshard
from graphshard.passes.runner import PassInvariantError, PassRunner


@pytest.fixture(scope="module")
def stages():
    with fake_process_group(2):
        torch.manual_seed(0)
        backend = graphshard.backend(inductor=False)
        model = graphshard.shard(BlockStack(2))
        torch.compile(model, backend=backend)(torch.randn(4, 8)).sum().backward()
        (graphs,) = backend.graphs
        yield graphs, backend


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    import copy

    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def test_the_backend_times_every_pass_through_the_runner(stages):
    _, backend = stages
    for name in ("dedupe_unshard", "fold_views", "reshard", "lower_unshard",
                 "lower_reduce_grad", "prefetch", "overlap_reduce"):
        assert backend.pass_seconds[name] > 0, name


def test_an_unwaited_collective_is_refused_naming_the_pass(stages):
    graphs, _ = stages

    def drop_a_wait(gm, plan):
        wait = calls(gm, c10d.wait_tensor.default)[0]
        wait.replace_all_uses_with(wait.args[0])
        gm.graph.erase_node(wait)
        return gm

    with pytest.raises(PassInvariantError, match="'drop_a_wait'.*waited on 0 times"):
        PassRunner().run("fw", [drop_a_wait], _copy(graphs["fw"]), Plan())


def test_a_node_without_meta_val_is_refused(stages):
    graphs, _ = stages

    def forget_meta(gm, plan):  # a block's matmul, or its region's call (torch 2.11 keeps it)
        node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target in MATMULS)
        del node.meta["val"]
        return gm

    with pytest.raises(PassInvariantError, match=r"'forget_meta'.*no meta\[\"val\"\]"):
        PassRunner().run("fw", [forget_meta], _copy(graphs["fw"]), Plan())


def test_a_pass_that_reorders_collectives_is_refused(stages):
    graphs, _ = stages

    def swap_gathers(gm, plan):
        first, second = calls(gm, c10d.all_gather_into_tensor.default)[:2]
        # move the second bucket's gather (and what feeds it) before the first one's
        feeding = []
        stack = [second]
        while stack:
            node = stack.pop()
            if node.op == "call_function" and node not in feeding:
                feeding.append(node)
                stack.extend(a for a in node.all_input_nodes)
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in sorted(feeding, key=position.get):
            first.prepend(node)
        return gm

    gm = _copy(graphs["fw"])
    assert len(calls(gm, c10d.all_gather_into_tensor.default)) >= 2
    with pytest.raises(PassInvariantError, match="'swap_gathers'.*reordered graphshard's"):
        PassRunner().run("fw", [swap_gathers], gm, Plan())


def test_a_marker_left_after_lower_unshard_is_refused(stages):
    graphs, _ = stages
    joint = graphs["joint"]
    markers = [n for n in joint.graph.nodes if is_unshard(n)]
    assert markers, "the joint graph holds unshard markers"

    def lower_unshard_badly(gm, plan):  # claims to be lower_unshard, lowers nothing
        return gm

    lower_unshard_badly.__name__ = lower_unshard.__name__
    with pytest.raises(PassInvariantError, match="an unshard marker after lower_unshard"):
        PassRunner().run("fw", [lower_unshard_badly], _copy(joint), Plan())


def test_the_runner_calls_its_hook_before_and_after_each_pass(stages):
    graphs, _ = stages
    seen = []

    def noop(gm, plan):
        return gm

    runner = PassRunner(after_each=lambda step, name, gm: seen.append((step, name)))
    runner.run("fw", [noop, noop], _copy(graphs["fw"]), Plan())
    assert seen == [(0, "input"), (1, "noop"), (2, "noop")]
    assert runner.seconds["noop"] > 0


@pytest.mark.parametrize("stage", ["fw", "bw"])
def test_lowered_collectives_point_at_the_users_code(stages, stage):
    """The gathers and reduce-scatters carry the stack trace and module of the parameter read
    they replace, so dumps and profiler traces name the model's line (``BlockStack`` lives in
    graph_utils.py), not graphshard's."""
    graphs, _ = stages
    gm = graphs[stage]
    collectives = [*calls(gm, c10d.all_gather_into_tensor.default),
                   *calls(gm, c10d.reduce_scatter_tensor.default)]
    assert collectives
    for node in collectives:
        assert "graph_utils.py" in node.meta.get("stack_trace", ""), node.format_node()
        if stage == "fw":  # AOTAutograd keeps the module stack on forward nodes only
            modules = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
            assert any("blocks" in path for path in modules), (node.format_node(), modules)


def test_the_per_parameter_spec_names_the_markers_arguments_in_order():
    """``shard()`` builds each parameter's fixed ``unshard`` arguments by name
    (``UnshardSpec``); they must be the schema's arguments after ``shard``, in order."""
    from graphshard.passes.markers import UNSHARD, UnshardArgs, UnshardSpec

    schema = [a.name for a in UNSHARD._schema.arguments]
    assert list(UnshardArgs._fields) == schema
    assert list(UnshardSpec._fields) == schema[1:1 + len(UnshardSpec._fields)]
    assert schema[1 + len(UnshardSpec._fields)] == "sync"  # the per-read arguments follow
