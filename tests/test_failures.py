"""Failures that must not hang or corrupt: a failing rank, ranks with different plans, and
inputs that would silently break a sharded model.

Real gloo ranks: a rank that raises and a rank that hangs (the other fails within the
process-group timeout, with an error naming the cause), plans that differ between ranks.
A rank killed mid-save is in ``test_checkpoint.py``. The rest are unit tests on a fake
process group.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from ckpt_utils import batch, build, launch, results
from dist_utils import full_state
from graph_utils import fake_process_group
from torch import fx, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

import graphshard
from graphshard.api.sharding import shard_state
from graphshard.models.mlp import OddMLP
from graphshard.passes import Plan
from graphshard.passes.markers import UNSHARD
from graphshard.safety.fingerprint import describe_differences, graph_fingerprint, shard_fingerprint
from graphshard.state.checkpoint import COMMIT_MARKER, latest_checkpoint

PG_TIMEOUT_S = 3.0


def _error(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "", "no error"


# --------------------------------------------------------------------------- real ranks


def job_plans_then_raise(rank: int, world_size: int) -> dict:
    out = {}
    # 1. a different model shape on rank 1: refused by shard(), before any collective
    sizes = (13, 29, 7, 3) if rank == 0 else (13, 30, 7, 3)
    out["shape"] = _error(lambda: graphshard.shard(OddMLP(sizes)))
    # 2. different buckets
    model = OddMLP()
    groups = [[model.layers[0]]] if rank == 0 else [[model.layers[0], model.layers[2]]]
    out["buckets"] = _error(lambda: graphshard.shard(model, buckets=groups))
    # 3. different values (another seed on rank 1): refused by shard(), naming them
    torch.manual_seed(rank)
    out["values"] = _error(lambda: graphshard.shard(OddMLP()))
    # 3b. the same parameters, a buffer that differs (a random projection built unseeded);
    # one registered after shard() may differ (per-rank state)
    torch.manual_seed(0)
    model = OddMLP()
    model.register_buffer("projection", torch.full((3,), float(rank)))
    out["buffer"] = _error(lambda: graphshard.shard(model))
    torch.manual_seed(0)
    model = graphshard.shard(OddMLP())
    model.register_buffer("projection", torch.full((3,), float(rank)))
    x, y = torch.randn(4, 13), torch.randn(4, 3)
    out["buffer_after"] = _error(lambda: model(x, y).loss.backward())
    # 4. different backend options: refused at the first compile, before the first gather
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = graphshard.shard(OddMLP())
    compiled = torch.compile(model, backend=graphshard.backend(prefetch_depth=1 + rank,
                                                               inductor=False))
    out["backend"] = _error(lambda: compiled(torch.randn(4, 13)))
    # 5. the process group still works after refusing: .double() after shard() trains right
    out["double"] = _train_double(rank, world_size)
    # 5b. eager forwards that differ between ranks: refused at the end of the forward
    out.update(_diverging_forwards(rank))
    # 5c. a data-dependent branch skips a module on one rank (compiled)
    out.update(_skipped_expert(rank))
    # 6. rank 1 raises (its process then exits); rank 0 is in the forward's all-gather
    model = graphshard.shard(build("awkward"))
    start = time.monotonic()
    try:
        with graphshard.report_rank_failures():
            model(*batch("awkward", 0, rank)).loss.backward()
            if rank == 1:
                raise ValueError("bad batch on rank 1")
            start = time.monotonic()
            model(*batch("awkward", 1, rank)).loss.backward()
    except Exception as exc:
        out["raise"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    return out


class TwoSame(torch.nn.Module):
    """Two same-shaped layers: their gathers pair up across layers if ranks swap them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)])
        self.reverse = False

    def forward(self, x):
        for layer in (self.layers[::-1] if self.reverse else self.layers):
            x = torch.relu(layer(x))
        return x.sum()


def _diverging_forwards(rank: int) -> dict:
    """Rank 1 alone: runs the layers in the other order, is inside no_sync, has frozen a
    layer, skipped an optimizer step. Each eager forward must be refused on both ranks."""
    torch.manual_seed(0)
    model = graphshard.shard(TwoSame())
    x = torch.randn(4, 8)
    out = {}
    model.reverse = rank == 1
    out["order"] = _error(lambda: model(x))
    model.reverse = False
    out["same"] = _error(lambda: model(x).backward())  # agreeing ranks train on
    if rank == 1:
        with graphshard.no_sync(model):
            out["no_sync"] = _error(lambda: model(x))
    else:
        out["no_sync"] = _error(lambda: model(x))
    model.zero_grad()
    model.layers[0].requires_grad_(rank == 0)
    out["frozen"] = _error(lambda: model(x))
    model.layers[0].requires_grad_(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(x).backward()
    if rank == 0:  # rank 1 skips this step
        optimizer.step()
    out["skipped_step"] = _error(lambda: model(x))
    # compiled: rank 1 alone in no_sync compiles another graph, refused at its first compile
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = graphshard.shard(TwoSame())
    compiled = torch.compile(model, backend=graphshard.backend(inductor=False))
    if rank == 1:
        with graphshard.no_sync(model):
            out["compiled_no_sync"] = _error(lambda: compiled(x))
    else:
        out["compiled_no_sync"] = _error(lambda: compiled(x))
    return out


class SkippingExperts(torch.nn.Module):
    """A mixture of experts that skips an expert no token was routed to: a data-dependent
    branch (after the graph break at ``torch.where``), so ranks trace different graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)])
        self.out = torch.nn.Linear(8, 2)

    def forward(self, x, route):
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = torch.where(route == e)[0]
            if idx.numel() == 0:
                continue
            y = y.index_add(0, idx, expert(x[idx]))
        return self.out(x + y).sum()


def _skipped_expert(rank: int) -> dict:
    """Rank 1 routes no token to the last expert, so it skips it: refused at the compile of
    the graph after the break, with what to change."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = graphshard.shard(SkippingExperts())
    compiled = torch.compile(model, backend=graphshard.backend(inductor=False))
    route = torch.tensor([0, 1, 2, 0] if rank == 0 else [0, 1, 1, 0])
    return {"skipped_expert": _error(lambda: compiled(torch.randn(4, 8), route))}


def _train_double(rank: int, world_size: int) -> float:
    """Shard, then ``.double()``: two SGD steps match a float64 single-process reference."""
    model = graphshard.shard(build("awkward")).double()
    reference = build("awkward").double()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(2):
        local = [t.double() for t in batch("awkward", step, rank)]
        model(*local).loss.backward()
        per_rank = [reference(*[t.double() for t in batch("awkward", step, r)]).loss
                    for r in range(world_size)]
        (sum(per_rank) / world_size).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = full_state(model)
    assert all(v.dtype == torch.float64 for v in full.values())
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


def job_hang(rank: int, world_size: int) -> dict:
    model = graphshard.shard(build("awkward"))
    with graphshard.report_rank_failures():
        model(*batch("awkward", 0, rank)).loss.backward()
        if rank == 1:
            time.sleep(60)  # stuck (killed by the test once rank 0 has failed)
        start = time.monotonic()
        try:
            model(*batch("awkward", 1, rank)).loss.backward()
        finally:
            print(f"rank {rank} waited {time.monotonic() - start:.1f} s", flush=True)
    return {}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return results(launch(job_plans_then_raise, 2, pg_timeout_s=PG_TIMEOUT_S, deadline_s=120,
                          grace_s=20))


def test_different_model_shapes_are_refused_before_the_first_collective(ranks):
    for out in ranks:
        kind, msg = out["shape"]
        assert kind == "PlanMismatchError"
        assert "sharded model differs between ranks" in msg
        assert ("parameter layers.0.weight: rank 0 has shape=(29, 13) dtype=torch.float32 "
                "bucket=0") in msg and "rank 1 has shape=(30, 13)" in msg
        assert "same model" in msg


def test_different_buckets_are_refused(ranks):
    for out in ranks:
        kind, msg = out["buckets"]
        assert kind == "PlanMismatchError"
        assert "buckets: rank 0 has" in msg and "layers.0+layers.2" in msg


def test_different_parameter_values_are_refused_by_shard(ranks):
    for out in ranks:
        kind, msg = out["values"]
        assert kind == "PlanMismatchError", msg
        assert ("parameter and buffer values given to graphshard.shard() differs between "
                "ranks") in msg
        assert "values of 'layers.0.weight': rank 0 has" in msg and "rank 1 has" in msg
        assert "torch.device('meta')" in msg and "to_empty" in msg


def test_a_buffer_that_differs_between_ranks_is_refused_by_shard(ranks):
    for out in ranks:
        kind, msg = out["buffer"]
        assert kind == "PlanMismatchError", msg
        assert "values of buffer 'projection': rank 0 has" in msg
        assert "values of 'layers.0.weight'" not in msg  # the parameters agree
        assert "register one meant to differ per rank after graphshard.shard()" in msg
        assert out["buffer_after"] == ("", "no error")


def test_different_backend_options_are_refused_at_compile(ranks):
    for out in ranks:
        kind, msg = out["backend"]
        assert kind == "BackendCompilerFailed"  # how torch.compile reports backend errors
        assert "PlanMismatchError: graphshard: the compiled plan differs" in msg
        assert "backend option prefetch_depth: rank 0 has 1, rank 1 has 2" in msg
        assert "with the same graphshard.backend(...) options" in msg
        assert "traced different code" not in msg  # the same parameters were read


@pytest.mark.parametrize("case, says", [
    ("order", "read 0 of the forward: rank 0 read 'layers.0.weight', rank 1 read "
              "'layers.1.weight'"),
    ("no_sync", "gradient sync 'synchronised', rank 1's with 'no_sync'"),
    ("frozen", "rank 0 read 'layers.0.weight', rank 1 read 'layers.0.weight' (frozen)"),
    ("skipped_step", "rank 0 has taken 1 optimizer step(s) on this model, rank 1 0"),
])
def test_eager_forwards_that_differ_between_ranks_are_refused_on_every_rank(ranks, case,
                                                                            says):
    for rank, result in enumerate(ranks):
        kind, msg = result[case]
        assert kind == "PlanMismatchError", (rank, msg)
        assert "the ranks ran different eager forwards" in msg and says in msg, msg
        if case == "order":
            assert "Call every module on every rank" in msg, msg
    assert all(result["same"] == ("", "no error") for result in ranks)


def test_a_rank_alone_in_no_sync_is_refused_at_the_first_compile(ranks):
    for result in ranks:
        kind, msg = result["compiled_no_sync"]
        assert kind == "BackendCompilerFailed"  # how torch.compile reports backend errors
        assert "PlanMismatchError: graphshard: the compiled plan differs" in msg
        assert "marker layers.0.weight" in msg and "sync=" in msg, msg
        assert "enter graphshard.no_sync(model)" in msg, msg


def test_a_module_skipped_on_one_rank_is_refused_with_what_to_change(ranks):
    for result in ranks:
        kind, msg = result["skipped_expert"]
        assert kind == "BackendCompilerFailed", msg
        assert "PlanMismatchError: graphshard: the compiled plan differs" in msg
        assert "marker experts.2.weight: only on rank 0" in msg, msg
        assert "marker out.weight: only on rank 1" in msg, msg
        assert "The ranks traced different code" in msg and "Call every module on every rank" \
            in msg, msg
        assert "backend(...) options" not in msg, msg  # the options agree


def test_dtype_change_after_shard_trains_correctly(ranks):
    for out in ranks:
        assert out["double"] < 1e-12


def test_a_rank_that_raises_fails_the_others_with_its_error(ranks):
    kind, msg, _ = ranks[1]["raise"]
    assert (kind, msg) == ("ValueError", "bad batch on rank 1")
    kind, msg, seconds = ranks[0]["raise"]
    assert kind == "RankFailureError"
    assert "rank 1 failed: ValueError: bad batch on rank 1" in msg
    assert seconds < PG_TIMEOUT_S + 2


def test_a_hung_rank_fails_the_others_within_the_timeout():
    start = time.monotonic()
    rank0, rank1 = launch(job_hang, 2, pg_timeout_s=PG_TIMEOUT_S, deadline_s=90, grace_s=1)
    assert rank1.exitcode is None  # still asleep: killed by the launcher
    assert rank0.error_type == "RankFailureError"
    assert f"process-group timeout {PG_TIMEOUT_S:g} s" in rank0.error
    assert "no rank reported an error" in rank0.error
    assert "init_process_group(timeout=" in rank0.error
    assert rank0.seconds < PG_TIMEOUT_S + 10
    assert time.monotonic() - start < 60


# --------------------------------------------------------------------------- fingerprint units


def test_shard_fingerprint_names_parameters_buckets_and_options():
    with fake_process_group(2):
        fp = shard_fingerprint(shard_state(graphshard.shard(OddMLP())))
    assert fp["world size"] == "2"
    assert fp["parameter layers.0.weight"] == (
        "shape=(29, 13) dtype=torch.float32 bucket=0 pinned=False requires_grad=True"
    )
    assert fp["buckets"] == '["layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "<rest>"]'
    assert fp["reshard_after_forward"] == "True"
    assert not any("rank" in key and key != "world size" for key in fp)  # rank-independent


def test_graph_fingerprint_reads_plan_options_and_markers():
    graph = fx.Graph()
    shard = graph.placeholder("shard")
    shard.meta["example_value"] = torch.empty(2, 6, dtype=torch.bfloat16)
    graph.output(graph.call_function(UNSHARD, (shard, [4, 6], 3, False, True, "fc.weight", 2,
                                               "group-name-not-compared")))
    fp = graph_fingerprint(fx.GraphModule(nn.Module(), graph), Plan(prefetch_depth=2))
    assert fp["backend option prefetch_depth"] == "2"
    assert fp["backend option profile"].startswith("HardwareProfile(name='cpu-gloo'")
    marker = fp["marker fc.weight"]
    assert "full_shape=[4, 6]" in marker and "bucket=3" in marker and "world_size=2" in marker
    assert "dtype=torch.bfloat16" in marker and "group" not in marker
    assert fp["marker order"] == '["fc.weight"]'


def test_describe_differences_names_each_key():
    a = {"world size": "2", "parameter w": "shape=(4,)", "only a": "1"}
    b = {"world size": "2", "parameter w": "shape=(5,)", "only b": "1"}
    text = describe_differences([a, b, a], [0, 1, 2])
    assert "rank 1 vs rank 0" in text and "rank 2" not in text
    assert "parameter w: rank 0 has shape=(4,), rank 1 has shape=(5,)" in text
    assert "only a: only on rank 0" in text and "only b: only on rank 1" in text


# --------------------------------------------------------------------------- guard units


def test_replacing_a_parameter_after_shard_is_refused():
    with fake_process_group(2):
        model = graphshard.shard(OddMLP())
        layer = model.layers[0]
        with pytest.raises(graphshard.ShardedModelError,
                           match=r"assign to parameter 'layers.0.weight'.*before calling "
                                 r"graphshard.shard\(\).*set_model_state_dict"):
            layer.weight = nn.Parameter(torch.zeros(29, 13))
        with pytest.raises(graphshard.ShardedModelError, match="delete parameter 'layers.0.bias'"):
            del layer.bias
        with pytest.raises(graphshard.ShardedModelError, match="re-register"):
            layer.register_parameter("weight", nn.Parameter(torch.zeros(29, 13)))
        assert layer._parameters["weight"] is shard_state(model).params[0].param
        layer.note = "other attributes are fine"
        assert layer.note == "other attributes are fine"


def test_dtensor_assignment_follows_but_tying_after_shard_is_refused():
    with fake_process_group(2):
        model = graphshard.shard(nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6)))
        entry = shard_state(model).params[0]
        same = nn.Parameter(torch.zeros_like(model[0].weight))  # what assign=True loads
        model[0].weight = same
        assert entry.param is same and model[0]._parameters["weight"] is same
        with pytest.raises(graphshard.ShardedModelError, match="assign to parameter '1.weight'"):
            model[1].weight = model[0].weight  # another shard: tie before shard() instead
        assert model[1]._parameters["weight"] is shard_state(model).params[2].param


def test_optimizer_on_the_pre_shard_parameters_is_refused():
    with fake_process_group(2):
        model = OddMLP()
        stale = torch.optim.SGD(model.parameters(), lr=0.1)
        graphshard.shard(model)
        with pytest.raises(graphshard.ShardedModelError,
                           match=r"holds parameter 'layers.0.weight' from before "
                                 r"graphshard.shard\(\).*Build the optimizer after sharding"):
            stale.step()
        good = torch.optim.SGD(model.parameters(), lr=0.1)
        good.step()  # built on the shards: accepted
        assert good.__dict__["_graphshard_checked"] == len(list(model.parameters()))


def test_to_dtype_after_shard_keeps_the_sharding():
    with fake_process_group(2):
        model = graphshard.shard(OddMLP()).to(torch.float64)
        state = shard_state(model)
        for entry in state.params:
            assert isinstance(entry.param, DTensor) and entry.param.dtype == torch.float64
            assert entry.param.shape == entry.full_shape
            assert entry.param.to_local().shape[0] == -(-entry.full_shape[0] // 2)  # rank 0
        assert model.layers[0]._parameters["weight"] is state.params[0].param
        assert model.layers[0].weight is state.params[0].param  # read outside forward


def test_to_with_new_parameter_objects_repoints_the_shards_and_keeps_ties():
    from graphshard.models.llama import Llama, llama_config

    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        with fake_process_group(2):
            model = graphshard.shard(Llama(llama_config("tiny", tie_embeddings=True)))
            before = [e.param for e in shard_state(model).params]
            hooks = [dict(p._backward_hooks or {}) for p in before]
            model.double()
            entries = shard_state(model).params
            # torch makes new Parameter objects or (DTensors) swaps their contents in place:
            # either way the record must point at what the module holds now (checked below)
            # gradient hooks graphshard put on the shards follow them to the new objects
            assert [dict(e.param._backward_hooks or {}) for e in entries] == hooks
            assert model.tok_embeddings._parameters["weight"] is \
                model.output._parameters["weight"]
            by_name = dict(model.named_parameters(remove_duplicate=False))
            for entry in entries:
                for name in entry.names:
                    assert by_name[name] is entry.param and entry.param.dtype == torch.float64
                    assert isinstance(entry.param, DTensor)
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


def test_load_state_dict_with_full_tensors_points_to_set_model_state_dict():
    with fake_process_group(2):
        full = OddMLP().state_dict()
        model = graphshard.shard(OddMLP())
        before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        with pytest.raises(graphshard.ShardedModelError,
                           match=r"plain tensor \(29, 13\) for 'layers.0.weight'.*"
                                 r"set_model_state_dict.*full_state_dict=True"):
            model.load_state_dict(full)
        assert all(torch.equal(before[k], v.to_local()) for k, v in model.state_dict().items())
        model.load_state_dict(model.state_dict())  # its own (DTensor) state dict still loads


def test_full_state_dict_of_another_model_is_refused_by_torch_naming_keys():
    """torch's set_model_state_dict checks full state dicts: its error names the keys."""
    with fake_process_group(2):
        model = graphshard.shard(OddMLP())
        bad = OddMLP((13, 30, 7, 3)).state_dict()
        bad["extra.weight"] = bad.pop("layers.4.bias")
        with pytest.raises(RuntimeError) as info:
            set_model_state_dict(model, bad, options=StateDictOptions(full_state_dict=True))
        msg = str(info.value)
        assert 'Unexpected key(s) in state_dict: "extra.weight"' in msg
        assert "size mismatch for layers.0.weight" in msg
def test_latest_checkpoint_skips_incomplete_saves(tmp_path: Path):
    for name, committed in [("step_00000002", True), ("step_00000009", False),
                            (".tmp-step_00000011", True), ("step_00000004", True)]:
        (tmp_path / name).mkdir()
        if committed:
            (tmp_path / name / COMMIT_MARKER).write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000004"
    # a replaced step whose replacement never landed is still found
    (tmp_path / "step_00000004").rename(tmp_path / ".old-step_00000004")
    assert latest_checkpoint(tmp_path) == tmp_path / ".old-step_00000004"
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    with pytest.raises(FileNotFoundError, match="no COMMITTED marker"):
        graphshard.load_checkpoint(tmp_path / "step_00000009", nn.Linear(1, 1))
