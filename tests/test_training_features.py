"""Training features (issue 5): frozen and tied parameters, BatchNorm buffers, activation
checkpointing, eval/no_grad, graph breaks and shape changes.

Numerics: every case trains on 2 real gloo ranks, eager and compiled, in ONE launch, against
a single-process reference. Structure: graph-level checks in this process on a fake group.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from dist_utils import run_ranks
from graph_utils import c10d, calls, derived_from, fake_process_group
from parity import assert_matches
from parity_features import (
    CASES,
    BatchNormNet,
    Blocks,
    Breaks,
    CheckpointTied,
    TiedAcross,
    build,
    frozen_mixed,
    run_jobs,
    tied_shard,
    train_reference,
)
from torch import fx

import graphshard
from graphshard.compiler.graph_breaks import GraphBreakWarning
from graphshard.passes.cost_model import all_gather_time
from graphshard.passes.layout import Dim0Layout

AG, RS = c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default
MODES = ("eager", "compiled")
JOBS = [(case, mode) for case in CASES for mode in MODES]


@pytest.fixture(scope="module")
def world2():
    return run_ranks(run_jobs, 2, JOBS)


@pytest.fixture(scope="module")
def references():
    return {case: train_reference(case, 2) for case in CASES}


# --- numerics on real ranks ------------------------------------------------------------------


@pytest.mark.parametrize("case,mode", JOBS)
def test_matches_single_process(world2, references, case, mode):
    for rank, rank_results in enumerate(world2):
        assert_matches(rank_results[(case, mode)], references[case][rank])


@pytest.mark.parametrize("mode", MODES)
def test_frozen_parameters_get_no_gradient_and_stay_put(world2, mode):
    init = build("frozen_tied").state_dict()
    for rank_results in world2:
        result = rank_results[("frozen_tied", mode)]
        assert result["frozen_with_grad"] == []
        for name in ("blocks.0.up.weight", "blocks.0.up.bias"):
            torch.testing.assert_close(result["state"][name], init[name], rtol=0, atol=0)
        trained = result["state"]["blocks.0.down.weight"]
        assert not torch.equal(trained, init["blocks.0.down.weight"])


@pytest.mark.parametrize("mode", MODES)
def test_lora_trains_only_the_adapters_and_reduces_only_theirs(world2, mode):
    """PEFT's LoRA (``test_matches_single_process[peft_lora-*]`` has the numerics): the frozen
    base weights keep their values and get no gradient; every adapter trains; and the compiled
    backward reduce-scatters the adapters' gradients and nothing else. PEFT's
    ``save_pretrained`` then writes the trained adapters whole."""
    init = build("peft_lora")
    adapters = sorted(n for n, p in init.named_parameters() if p.requires_grad)
    assert len(adapters) == 8 and all(".lora_" in n for n in adapters)  # 2 layers x q, v x A, B
    for rank_results in world2:
        result = rank_results[("peft_lora", mode)]
        assert result["frozen_with_grad"] == []
        for name, param in init.named_parameters():
            moved = not torch.equal(result["state"][name], param)
            assert moved == param.requires_grad, name
        if mode == "compiled":
            assert result["reduced_params"] == adapters
        # PEFT's save_pretrained writes each adapter whole, as trained (its keys drop the
        # adapter's name, "default")
        saved = result["saved_adapters"]
        saved_as = {name: name.replace(".default.", ".") for name in adapters}
        assert sorted(saved) == sorted(saved_as.values())
        for name, key in saved_as.items():
            assert torch.equal(saved[key], result["state"][name]), name


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_statistics_stay_per_rank(world2, mode):
    """As in DDP: each rank's running statistics come from its own batches only."""
    means = [r[("batchnorm_eval", mode)]["state"]["net.1.running_mean"] for r in world2]
    assert not torch.allclose(means[0], means[1])
    states = [r[("batchnorm_eval", mode)]["state"] for r in world2]
    counts = [int(state["net.1.num_batches_tracked"]) for state in states]
    assert counts == [4, 4]  # 5 steps, one of them eval


def test_graph_break_warning_names_the_break_on_real_ranks(world2):
    for rank_results in world2:
        messages = rank_results[("breaks_reshape", "compiled")]["break_warnings"]
        assert messages, "a graph break in a sharded model must warn"
        assert any("print" in m and "parity_features.py" in m for m in messages)
        assert rank_results[("breaks_reshape", "eager")]["break_warnings"] == []


def test_references_train(references):
    """Guard against a parity that holds because nothing trains (random targets: the losses
    need not fall, but the weights must move; a Linear bias before BatchNorm gets no gradient)."""
    for case in CASES:
        losses = references[case][0]["losses"]
        assert len(set(losses)) == len(losses), case
        init, final = build(case), references[case][0]["state"]
        for name, param in init.named_parameters():
            if name.endswith("weight"):
                assert torch.equal(final[name], param) != param.requires_grad, (case, name)


# --- graph structure on a fake process group -------------------------------------------------


@pytest.fixture
def fake2():
    with fake_process_group(2):
        torch.manual_seed(0)
        yield


def _step(model, *inputs, **backend_options) -> list[dict[str, fx.GraphModule]]:
    backend = graphshard.backend(inductor=False, **backend_options)
    torch.compile(model, backend=backend)(*inputs).backward()
    return backend.graphs


def _regression(rows: int = 4) -> tuple:
    return torch.randn(rows, 8), torch.randn(rows, 3)


def _params(node: fx.Node) -> list[str]:
    return node.meta["graphshard"]["params"]


def test_mixed_bucket_reduces_only_its_trainable_parameters(fake2):
    model = frozen_mixed()
    graphshard.shard(model)
    (stages,) = _step(model, *_regression(), reshard_last_bucket=True)
    gathers = {n.meta["graphshard"]["bucket"]: _params(n) for n in calls(stages["fw"], AG)}
    assert {"blocks.0.up.weight", "blocks.0.down.weight"} <= set(gathers[0])  # one bucket
    (reduce0,) = [n for n in calls(stages["bw"], RS) if n.meta["graphshard"]["bucket"] == 0]
    assert sorted(_params(reduce0)) == ["blocks.0.down.bias", "blocks.0.down.weight"]
    trainable = [p for n, p in Blocks().named_parameters() if n.startswith("blocks.0.down")]
    numel = 2 * sum(Dim0Layout(p.shape, 2).piece_numel for p in trainable)
    assert reduce0.args[0].meta["val"].numel() == numel
    reduced = {n for rs in calls(stages["bw"], RS) for n in _params(rs)}
    assert "head.bias" not in reduced and "head.weight" in reduced


def test_tied_weight_across_buckets_is_gathered_and_reduced_once(fake2):
    model = TiedAcross()
    tied_shard(model)
    tokens = torch.randint(0, 16, (4,))
    (stages,) = _step(model, tokens, tokens, reshard_last_bucket=True)
    for stage, op in (("fw", AG), ("bw", RS)):
        names = [n for node in calls(stages[stage], op) for n in _params(node)]
        tied = [n for n in names if n in ("emb.weight", "head.weight")]
        assert len(tied) == 1, (stage, names)
    # The head's bucket (0) owns the weight: the embedding reads it from there.
    (owner,) = [n for n in calls(stages["fw"], AG) if "emb.weight" in _params(n)]
    assert owner.meta["graphshard"]["bucket"] == 0


def test_checkpointed_block_is_gathered_once_in_backward(fake2):
    """Recompute and gradient share one gather per bucket, not one each."""
    for once in (True, False):  # blocks as compile regions, or inlined in the step graph
        (stages,) = _step(graphshard.shard(Blocks(ckpt=True), compile_blocks_once=once),
                          *_regression(), reshard_last_bucket=True)
        buckets = collections.Counter(n.meta["graphshard"]["bucket"]
                                      for n in calls(stages["bw"], AG))
        assert buckets == {0: 1, 1: 1, 2: 1}
    tags = {n.meta.get("recompute") for n in stages["joint"].graph.nodes} - {None}
    assert len(tags) > 1  # checkpoint's own PREFER_RECOMPUTE beside the markers' policy


def test_checkpoint_reads_from_inside_and_outside_reduce_once_and_reshard(fake2):
    """A weight read twice inside a checkpoint body, a tied weight read inside and outside it,
    a weight passed into checkpoint: one reduction per parameter, nothing saved unsharded."""
    tokens = torch.randint(0, 16, (4,))
    (stages,) = _step(graphshard.shard(CheckpointTied()), tokens, tokens,
                      reshard_last_bucket=True)
    names = [n for n, _ in CheckpointTied().named_parameters()]
    reduced = [n for rs in calls(stages["bw"], RS) for n in _params(rs)]
    assert sorted(reduced) == sorted(names)
    full = dict(CheckpointTied().named_parameters())
    numel = sum(rs.args[0].meta["val"].numel() for rs in calls(stages["bw"], RS))
    assert numel == 2 * sum(Dim0Layout(p.shape, 2).piece_numel for p in full.values())
    fw = stages["fw"]
    outputs = fw.graph.find_nodes(op="output")[0].args[0]
    assert not derived_from(*calls(fw, AG)) & set(outputs)  # the forward saves only shards
    buckets = collections.Counter(n.meta["graphshard"]["bucket"] for n in calls(stages["bw"], AG))
    assert set(buckets.values()) == {1}


def _returned(gm: fx.GraphModule) -> set[fx.Node]:
    (out,) = gm.graph.find_nodes(op="output")
    found: list[fx.Node] = []
    fx.node.map_arg(out.args, found.append)
    return set(found)


@pytest.mark.parametrize("model_cls", [Blocks, BatchNormNet])
def test_eval_no_grad_is_forward_only_and_frees_gathers(fake2, model_cls):
    model = graphshard.shard(model_cls()).eval()
    backend = graphshard.backend(inductor=False)
    with torch.no_grad():
        torch.compile(model, backend=backend)(*_regression())
    (stages,) = backend.graphs
    graph = stages["inference"]
    assert set(stages) == {"dynamo", "inference"} and calls(graph, RS) == []
    gathers = calls(graph, AG)
    assert len(gathers) == len({n.meta["graphshard"]["bucket"] for n in gathers}) >= 2
    assert not derived_from(*gathers) & _returned(graph)


def test_graph_break_warns_with_reason_location_and_cost(fake2):
    model = graphshard.shard(Breaks())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphs = _step(model, *_regression())
    (warning,) = [w for w in caught if w.category is GraphBreakWarning]
    message = str(warning.message)
    assert "parity_features.py" in message and 'print("", end="")' in message
    assert "builtin operator `print`" in message
    assert warning.filename.endswith("parity_features.py")  # shown at the user's line
    after = next(g["fw"] for g in graphs[1:] if "fw" in g and calls(g["fw"], AG))
    first = calls(after, AG)[0].meta["val"]
    nbytes = first.numel() * first.element_size()
    assert f"+1 exposed all-gather ({nbytes:,} bytes" in message
    seconds = all_gather_time(nbytes, 2, graphshard.backend().plan.profile)
    assert f"{seconds * 1e3:.3f} ms" in message
    assert "+1 exposed reduce-scatter" in message


def test_a_graph_break_after_coalesced_gathers_is_costed_the_same(fake2):
    """``all_gather_via="coalesced"``: the gather after a break is a list of parameters; the
    warning prices the same bytes as the flat buffer's."""
    messages = {}
    for via in ("flat", "coalesced"):
        torch.manual_seed(0)
        model = graphshard.shard(Breaks())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step(model, *_regression(), all_gather_via=via)
        (warning,) = [w for w in caught if w.category is GraphBreakWarning]
        messages[via] = str(warning.message)
    assert "+1 exposed all-gather (" in messages["coalesced"]
    assert messages["coalesced"] == messages["flat"]


class BreakAfterUse(Blocks):
    def forward(self, x, y):
        loss = super().forward(x, y)
        print("", end="")  # after every parameter use: costs no collective
        return loss * 1.0


def test_no_warning_without_a_costly_break(fake2):
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphBreakWarning)
        _step(graphshard.shard(Blocks()), *_regression())
        _step(graphshard.shard(BreakAfterUse()), *_regression())
        _step(graphshard.shard(Blocks()), *_regression())  # nothing left pending


@pytest.mark.parametrize("bucketing", ["block", "auto"])
def test_shape_change_recompiles_once_with_a_dynamic_batch(fake2, bucketing):
    """The cost model prices SymInts by their hint: pricing must not specialise the batch."""
    backend = graphshard.backend(inductor=False, bucketing=bucketing)
    compiled = torch.compile(graphshard.shard(Blocks()), backend=backend)
    for rows in (4, 6, 8, 5):
        compiled(*_regression(rows)).backward()
    assert len(backend.graphs) == 2
    inputs = backend.graphs[1]["fw"].graph.find_nodes(op="placeholder")
    assert any(isinstance(n.meta.get("val"), torch.SymInt) for n in inputs)
    static, dynamic = (len(calls(g["bw"], RS)) for g in backend.graphs)
    assert dynamic == static >= 1
