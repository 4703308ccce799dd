"""The step's edges: the forward's leading gathers issued by the optimizer step
(``step_prefetch``), the backward's last reduce-scatters split by readiness
(``split_last_reduce``).

Graph level (one process, fake process group): which gathers are bound, which reductions are
split, and that bytes and order are unchanged. Optimizer level (one process): updating a
subset of the parameters first is bit-identical to one step for every optimizer the hook
splits. Numerics (2 gloo ranks, one launch): both features on train bit-identically to both
off and match one process; edits between step and forward, a second forward, ``no_sync``
and an optimizer that is not per-parameter; where the gathers run (profiler).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_utils import run_ranks
from graph_utils import TwoBlock, c10d, calls, fake_process_group, schedule_string
from parity import assert_matches
from step_edges_jobs import (
    LEFTOVER_JOB,
    STEPS,
    gather_after_its_input_changed,
    run_jobs,
    train_reference,
)

import graphshard
from graphshard.analysis.report import step_summary
from graphshard.api.step_prefetch import PER_PARAMETER, _SplitGroups, _SplitView
from graphshard.models.llama import Llama, llama_config
from graphshard.passes.markers import TAKE_PREFETCHED
from graphshard.passes.step_prefetch import leading_gathers

RS = c10d.reduce_scatter_tensor.default


def _stages(model, tokens, buckets=None, **options):
    torch._dynamo.reset()
    backend = graphshard.backend(inductor=False, **options)
    sharded = graphshard.shard(model, buckets=buckets)
    torch.compile(sharded, backend=backend)(tokens).loss.backward()
    (stages,) = backend.graphs
    return stages, backend


def _llama(name: str, **overrides):
    torch.manual_seed(0)
    return Llama(llama_config(name, **overrides))


# ----------------------------------------------------------------------------- graphs


@pytest.mark.parametrize("depth, bound", [(0, 1), (1, 2), (2, 3)])
def test_the_gathers_before_the_first_compute_are_bound(depth, bound):
    with fake_process_group(2):
        tokens = torch.randint(0, 256, (2, 16))
        on, _ = _stages(_llama("tiny"), tokens, prefetch_depth=depth, step_prefetch=True)
        off, _ = _stages(_llama("tiny"), tokens, prefetch_depth=depth)
    takes = [n for n in on["fw"].graph.nodes if n.target is TAKE_PREFETCHED]
    assert len(takes) == bound
    assert not [n for n in off["fw"].graph.nodes if n.target is TAKE_PREFETCHED]
    assert not [n for n in on["bw"].graph.nodes if n.target is TAKE_PREFETCHED]
    # The same schedule, sizes and waits: only the leading gathers' op changed.
    assert schedule_string(on["fw"]) == schedule_string(off["fw"])
    lead = takes[0].kwargs["lead"]
    for take in takes:
        assert take.kwargs["lead"] == lead and take.kwargs["key"] in lead
        (wait,) = take.users
        assert wait.target is c10d.wait_tensor.default
        assert all(s.op == "placeholder" for s in take.kwargs["shards"])
        assert sum(take.kwargs["piece_numels"]) == take.args[0].meta["val"].numel()
        assert take.meta["graphshard"]["kind"] == "unshard"
    assert len(leading_gathers(off["fw"].graph)) == bound


def test_a_gather_the_step_cannot_rebuild_is_left_alone():
    """A gather input that is not the lowering's plain pieces of shards (here: a copy of a
    shard first, as CPU offload makes) stays an all-gather; the others are still bound."""
    from graphshard.passes import Plan, step_prefetch
    from graphshard.passes.fx_util import NodeMaker

    with fake_process_group(2):  # the gathers as the lowering builds them for step_prefetch
        off, _ = _stages(_llama("tiny"), torch.randint(0, 256, (2, 16)), step_prefetch=False,
                         gather_from_storage=False)
    fw = off["fw"]
    first, second = leading_gathers(fw.graph)
    shard = first.args[0]  # down to the node that reads the shard (the first piece's)
    while shard.all_input_nodes[0].op != "placeholder":
        shard = next(n for n in shard.all_input_nodes if n.op != "placeholder")
    with fw.graph.inserting_before(shard):
        copy = NodeMaker(fw.graph)(torch.ops.aten._to_copy.default, shard.args[0])
    shard.replace_input_with(shard.args[0], copy)
    step_prefetch(fw, Plan(step_prefetch=True))
    assert first.target is c10d.all_gather_into_tensor.default
    assert second.target is TAKE_PREFETCHED and second.kwargs["peers"] == []


def test_bound_gathers_are_priced_and_counted_as_all_gathers():
    with fake_process_group(2):
        tokens = torch.randint(0, 256, (2, 16))
        _, on = _stages(_llama("tiny"), tokens)
        _, off = _stages(_llama("tiny"), tokens, step_prefetch=False)
    summary_on = step_summary(on.graphs, on.plan.profile)
    summary_off = step_summary(off.graphs, off.plan.profile)
    for key in ("all_gathers", "reduce_scatters", "bytes_sent_per_rank", "peak_unsharded_bytes"):
        assert summary_on[key] == summary_off[key], key


def test_the_root_buckets_early_gradients_are_reduced_first():
    """llama-small, the blocks named as buckets: the last bucket holds the output layer
    (gradient ready first) and the embedding (ready last); its reduction splits, the rest
    does not."""
    with fake_process_group(2):
        tokens = torch.randint(0, 2048, (4, 128))
        models = _llama("llama-small"), _llama("llama-small")
        on, backend_on = _stages(models[0], tokens, buckets=list(models[0].layers))
        off, backend_off = _stages(models[1], tokens, buckets=list(models[1].layers),
                                   split_last_reduce=False)
    params = [n.meta["graphshard"]["params"] for n in calls(on["bw"], RS)]
    assert [n.meta["graphshard"]["params"] for n in calls(off["bw"], RS)][-1] == [
        "output.weight", "norm.weight", "tok_embeddings.weight"]
    assert params[0] == ["output.weight", "norm.weight"]  # issued before every block's
    assert params[-1] == ["tok_embeddings.weight"]
    assert params[1:-1] == [n.meta["graphshard"]["params"] for n in calls(off["bw"], RS)][:-1]
    # The same bytes, one more collective.
    on_sum = step_summary(backend_on.graphs, backend_on.plan.profile)
    off_sum = step_summary(backend_off.graphs, backend_off.plan.profile)
    assert on_sum["bytes_sent_per_rank"] == off_sum["bytes_sent_per_rank"]
    assert on_sum["reduce_scatters"] == off_sum["reduce_scatters"] + 1
    assert on_sum["predicted_exposed_comm_s"] < off_sum["predicted_exposed_comm_s"]


def _stages_plain(model, **options):
    torch._dynamo.reset()
    backend = graphshard.backend(inductor=False, **options)
    torch.compile(graphshard.shard(model), backend=backend)(torch.randn(4, 8)).sum().backward()
    (stages,) = backend.graphs
    return stages, backend


def test_a_reduction_with_nothing_to_gain_is_left_whole():
    with fake_process_group(2):
        torch.manual_seed(0)
        on, _ = _stages_plain(TwoBlock())
        torch.manual_seed(0)
        off, _ = _stages_plain(TwoBlock(), split_last_reduce=False)
    assert schedule_string(on["bw"]) == schedule_string(off["bw"])


# ----------------------------------------------------------------------------- optimizers

_CONFIGS = {
    torch.optim.SGD: [{"lr": 0.1}, {"lr": 0.1, "momentum": 0.9, "nesterov": True,
                                    "weight_decay": 0.01},
                      {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "maximize": True}],
    torch.optim.Adam: [{"lr": 0.01}, {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1}],
    torch.optim.AdamW: [{"lr": 0.01}, {"lr": 0.01, "amsgrad": True, "maximize": True}],
    torch.optim.Adagrad: [{"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.1}],
    torch.optim.Adamax: [{"lr": 0.01, "weight_decay": 0.1}],
    torch.optim.NAdam: [{"lr": 0.01}, {"lr": 0.01, "decoupled_weight_decay": True,
                                       "weight_decay": 0.1}],
    torch.optim.RAdam: [{"lr": 0.01, "weight_decay": 0.1}],
    torch.optim.RMSprop: [{"lr": 0.01, "momentum": 0.9, "centered": True}],
    torch.optim.Adadelta: [{"lr": 1.0, "weight_decay": 0.1}],
    torch.optim.ASGD: [{"lr": 0.01, "t0": 1}],
    torch.optim.Rprop: [{"lr": 0.01}],
}
_FUSED = {torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad}
_SPLIT_CASES = [
    (cls, config, mode)
    for cls, configs in _CONFIGS.items()
    for config, mode in itertools.product(configs, ("single", "foreach", "fused"))
    if mode != "fused" or cls in _FUSED
]


def test_every_split_optimizer_is_covered():
    assert set(_CONFIGS) == PER_PARAMETER


@pytest.mark.parametrize("cls, config, mode", _SPLIT_CASES,
                         ids=[f"{c.__name__}-{i}-{m}" for i, (c, _, m) in enumerate(_SPLIT_CASES)])
def test_a_split_step_is_bit_identical_to_one_step(cls, config, mode):
    """The hook's split (a subset of every group first, then the rest) against the same
    optimizer stepped whole, over 4 steps: parameters and state, bit for bit."""
    shapes = [(7, 3), (5,), (4, 4, 2), (), (1, 9), (6,)]

    def params():
        gen = torch.Generator().manual_seed(0)
        return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]

    kind = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    whole, split = params(), params()
    opts = [cls([{"params": ps[:3]}, {"params": ps[3:], "lr": config["lr"] / 2}],
                **config, **kind[mode]) for ps in (whole, split)]
    first = {id(split[1]), id(split[4]), id(split[5])}
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        for a, b in zip(whole, split, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opts[0].step()
        before, between = [p.detach().clone() for p in split], []
        view = _SplitView(opts[1], _SplitGroups(
            opts[1].param_groups, first, lambda seen=between: seen.append(
                [p.detach().clone() for p in split])))
        type(opts[1]).step.__wrapped__(view)  # what the optimizer's step wrapper calls
        (seen,) = between  # called once, when the subset was updated and the rest not yet
        changed = [not torch.equal(s, b) for s, b in zip(seen, before, strict=True)]
        assert changed == [id(p) in first for p in split]
    for a, b in zip(whole, split, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(whole, split, strict=True):
        for key, value in opts[0].state[a].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opts[1].state[b][key]))


# ----------------------------------------------------------------------------- numerics

# (optimizer, precision, scenario); each runs with both features on and off.
CASES = [
    ("adam", "fp32", "plain"),
    ("sgd", "bf16", "plain"),
    ("adamw", "fp32", "edit"),
    ("adamw", "fp32", "twice"),
    ("sgd", "fp32", "accum"),
    ("global_norm", "fp32", "plain"),
]
JOBS = [(*case, feature) for case in CASES for feature in (True, False)]

# Per scenario: (fresh, taken, stale) gathers of the forward, with 2 leading gathers.
_COUNTS = {
    "plain": (2, 2 * (STEPS - 1), 0),
    "edit": (2, STEPS - 1, STEPS - 1),  # the embedding's bucket stale both times
    "twice": (2 + 2 * STEPS, 2 * (STEPS - 1), 0),  # the second forward of each step
    "accum": (2 + 2 * STEPS, 2 * (STEPS - 1), 0),  # the micro-batch outside no_sync
}


@pytest.fixture(scope="module")
def world2():
    return run_ranks(run_jobs, 2, JOBS)


def _ids(cases):
    return ["-".join(case) for case in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_on_trains_bit_identically_to_off(world2, case):
    for rank in world2:
        on, off = rank[(*case, True)], rank[(*case, False)]
        assert on["losses"] == off["losses"]
        for key, value in off["state"].items():
            assert torch.equal(on["state"][key], value), key


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == "fp32"],
                         ids=_ids([c for c in CASES if c[1] == "fp32"]))
def test_on_matches_one_process(world2, case):
    reference = train_reference(case[0], case[2], 2)
    assert_matches(world2[0][(*case, True)], reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_forward_gathers_fresh_or_prefetched(world2, case):
    opt, _, scenario = case
    fresh, taken, stale = _COUNTS[scenario]
    for rank in world2:
        stats = rank[(*case, True)]["stats"]
        assert (stats["fresh"], stats["taken"], stats["stale"]) == (fresh, taken, stale)
        assert stats["issued"] == 2 * STEPS
        assert stats["split_steps"] == (0 if opt == "global_norm" else STEPS)
        assert rank[(*case, False)]["stats"] == dict.fromkeys(stats, 0)


def test_a_leftover_models_gathers_are_not_taken_by_another(world2):
    """A model of the same shape still alive on one rank, its last step's gathers pending:
    the next model trains as it does alone (before, its ``no_sync`` forward, whose
    parameters AOTAutograd detaches, found no model and took the leftover's gathers on that
    rank only, so the ranks ran different collectives and hung)."""
    for rank in world2:
        alone, beside = rank[LEFTOVER_JOB], rank["leftover"]
        assert beside["losses"] == alone["losses"]
        assert beside["stats"] == alone["stats"]
        for key, value in alone["state"].items():
            assert torch.equal(beside["state"][key], value), key


def test_a_gather_in_flight_does_not_read_its_input_after_the_kernel():
    """The forward's own gather (nothing prefetched) is still in flight when the kernel
    returns, and the compiler does not know it reads its input until the graph's wait:
    it gathers from a copy. (Before, torch 2.14.1's Inductor wrote the next bucket's input
    into that buffer before the wait, and training with ``step_prefetch`` on differed from
    off now and then.)"""
    expected = torch.tensor([1.0] * 4 + [2.0] * 4)
    for gathered in run_ranks(gather_after_its_input_changed, 2):
        assert torch.equal(gathered, expected), gathered


def test_an_optimizer_that_is_not_per_parameter_steps_whole(world2):
    for rank in world2:
        on = rank[("global_norm", "fp32", "plain", True)]
        # Its own step saw every parameter at once, each time; the gathers were issued
        # after it and taken by the next forward.
        assert on["global_norm_calls"] == [on["global_norm_calls"][0]] * STEPS
        assert on["stats"]["taken"] == 2 * (STEPS - 1)


def test_the_gathers_run_during_the_optimizer_step(world2):
    """Profiled: the leading buckets' gathers start inside ``optimizer.step()`` with
    parameter updates after them; the next forward takes them without gathering."""
    for rank in world2:
        events = rank["profile"]["events"]
        (step,) = [e for e in events if e[0] == "edges::step"]
        (forward,) = [e for e in events if e[0] == "edges::forward"]

        def within(span, name, events=events):
            return [e for e in events if name(e[0]) and span[1] <= e[1] and e[2] <= span[2]]

        def is_gather(name):
            return name.startswith(("c10d::", "_c10d_functional::")) and "gather" in name

        gathers = within(step, is_gather)
        assert len(gathers) == 2
        updates = within(step, "aten::addcdiv_".__eq__)  # AdamW's parameter update
        assert any(u[1] < gathers[0][1] for u in updates)  # the leading buckets' first
        assert any(u[1] > gathers[-1][2] for u in updates)  # the rest while they fly
        takes = within(forward, "graphshard::take_prefetched".__eq__)
        assert len(takes) == 2
        for take in takes:
            assert not within(take, is_gather)
        assert rank["profile"]["stats"]["taken"] == 2


def test_importing_graphshard_hooks_no_optimizer():
    """The global optimizer step hooks are registered by the first bound gather's kernel,
    not at import: a process that never turns ``step_prefetch`` on keeps plain steps."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import graphshard, torch\n"
        "from torch.optim.optimizer import _global_optimizer_post_hooks as post, "
        "_global_optimizer_pre_hooks as pre\n"
        "from graphshard.api import step_prefetch\n"
        "name = step_prefetch.__name__\n"
        "ours = lambda hooks: [h for h in hooks.values() if h.__module__ == name]\n"
        "assert not ours(pre) and not ours(post) and not step_prefetch._HOOKS, (pre, post)\n"
        "step_prefetch._install_hooks(); step_prefetch._install_hooks()\n"
        "assert len(ours(pre)) == len(ours(post)) == 1, (pre, post)\n"
    )
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
