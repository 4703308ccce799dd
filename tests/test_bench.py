"""Tests of the step benchmark (``python -m bench.step``) and its fake world.

Two bench launches are shared by the tests (module fixtures): two gloo ranks with the peers
in fp32, compiled with Inductor as users run them, and a one-process fake world in bf16
(``--mixed-precision bf16``) compiled without Inductor (``--compiler aot_eager``: its tests
check the systems, collectives, bytes and losses, not generated code, in a fifth of the
time). The fake world's collectives and groups are also checked in this process.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from bench.comm import count_collectives
from bench.fake_world import collective_seconds
from bench.report import add_loss_checks, add_ratios, fake_world_lines, header
from bench.step import (
    FIELDS,
    _attempt,
    describe_exception,
    main,
    parse_args,
    summarize,
    to_markdown,
)
from bench.systems import BenchContext, PeerUnavailable, block_bucket_plans, variant_options
from bench.timing import inline_collective_stats, round_ratios
from graphshard._torch_version import installed_torch_version
from graphshard.models.llama import CONFIGS, Llama, llama_config

SYSTEMS = [
    "graphshard-compiled",
    "graphshard-compiled-step-prefetch",
    "graphshard-compiled-rs-collective",
    "graphshard-eager",
    "fsdp2-eager",
    "fsdp2-prefetch-eager",
    "simplefsdp-compiled",
    "simplefsdp-block-bucketing",
    "ddp-compiled",
    "single-compiled",
]
# The fake world (bf16) runs the compiled graphs' functional collectives of graphshard and
# SimpleFSDP, and DDP and single-compiled under autocast; the same world size as the first
# run. A variant: graphshard-compiled keeping the forward's gathers for backward.
NO_RESHARD = "graphshard-compiled[reshard_after_forward=False]"
# In a fake world the sharded systems all train the tiled shards (one model), DDP and
# single-compiled the full model (another: DDP's mean of N equal gradients is the local one).
FAKE_SHARDED = ["graphshard-compiled", "graphshard-eager", "fsdp2-eager", NO_RESHARD,
                "simplefsdp-compiled"]
FAKE_FULL = ["ddp-compiled", "single-compiled"]
FAKE_SYSTEMS = FAKE_SHARDED + FAKE_FULL
# bf16 losses of two systems computing the same steps differently (compiled, which keeps
# fused intermediates in fp32, or eager, which rounds every op to bf16) agree to about
# bf16's resolution (2**-7): 1.5e-3 apart after 3 steps of the fake world here.
BF16_REL = 1e-2
TINY = ["--model", "tiny", "--seq-len", "16", "--batch-size", "2"]


def _triton_runs() -> bool:
    """Whether triton is installed and finds a GPU driver: a CUDA build of torch on a
    machine without a GPU (torch 2.14.1's wheel here) has triton but no driver."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        from triton.runtime.driver import driver

        driver.active  # noqa: B018  (raises where no driver is found)
    except Exception:
        return False
    return True


HAS_TRITON = _triton_runs()
# In the test extra (Python >= 3.11); elsewhere its rows must say why they did not run.
HAS_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None


def _run(tmp_path, *args: str) -> tuple[dict, str]:
    out, md = tmp_path / "bench.json", tmp_path / "bench.md"
    report = main([*TINY, "--json", str(out), "--markdown", str(md), *args])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    return report, md.read_text()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[dict, str]:
    """One interleaved run of the systems on two gloo ranks (3 steps, 1 warm-up)."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    return _run(tmp, "--world-size", "2", "--steps", "3", "--warmup", "1", "--systems", *SYSTEMS)


@pytest.fixture(scope="module")
def fake_world(tmp_path_factory) -> tuple[dict, str]:
    """One run in a fake world of 2 ranks (one process) in bf16, a learning rate that moves
    fast."""
    tmp = tmp_path_factory.mktemp("fake_world")
    args = ["--fake-world", "2", "--steps", "3", "--warmup", "1", "--lr", "1e-2",
            "--optimizer", "fused", "--mixed-precision", "bf16", "--compiler", "aot_eager"]
    return _run(tmp, *args, "--systems", *FAKE_SYSTEMS)


def _by_name(report: dict) -> dict[str, dict]:
    return {s["system"]: s for s in report["systems"]}


# ----------------------------------------------------------------------------- two ranks


@pytest.mark.timeout(600)
def test_bench_two_ranks_report(two_ranks):
    report, table = two_ranks
    assert {"platform", "cpu_count", "torch", "device_name"} <= set(report["machine"])
    assert report["config"]["world_size"] == 2 and not report["config"]["sequential"]
    assert report["config"]["mixed_precision"] == "none" and "fp32 (no mixed precision)" in table
    assert report["reference"]["b_param"] == 4 and "(2*4 + 4)" in table
    systems = _by_name(report)
    assert list(systems) == SYSTEMS
    ran = [s for s in systems.values() if s["step_s_median"] is not None]
    for s in ran:
        assert set(FIELDS) <= set(s), s["system"]
        assert "losses depart" not in (s["notes"] or ""), s  # every system trains alike
        assert s["step_s_p10"] <= s["step_s_median"] <= s["step_s_p90"], s
        assert s["peak_mem_bytes"] > 0 and s["final_loss"] is not None, s
        assert len(s["round_step_s"]) == 2, s  # 3 steps, 1 warm-up, rounds of 1
    gs = systems["graphshard-compiled"]
    assert isinstance(gs["bytes_per_step"], int) and gs["bytes_per_step"] > 0
    assert gs["collectives_per_step"] > 0 and gs["predicted_step_s"] > 0
    assert all(name in table for name in SYSTEMS)
    assert table == to_markdown(report)


def test_graphshard_rows_count_waits_copies_and_the_step_prefetch_check(two_ranks):
    systems = _by_name(two_ranks[0])
    off, on = systems["graphshard-compiled"], systems["graphshard-compiled-step-prefetch"]
    for s in (on, off):
        assert s["wait_s"] is not None and s["wait_s"] > 0, s
        assert 0 < s["copy_floor_bytes"] <= s["copy_bytes_per_step"], s
        # the summary's count (gathers, reduce-scatters, the forward's check) is what ran
        assert "profiler saw" not in (s["notes"] or ""), s["notes"]
    assert on["graphshard_summary"]["checks"] == 1 and off["graphshard_summary"]["checks"] == 0
    # 7 steps (3, the profiled one, then the 3 of the host-tax profile), each issuing its 2
    # leading buckets (prefetch_depth 1); every forward but the first took what the step
    # before it gathered
    prefetch = on["step_prefetch"]
    assert prefetch["stale"] == 0 and prefetch["fresh"] == 2, prefetch
    assert prefetch["taken"] == 2 * 6 and prefetch["issued"] == 2 * 7, prefetch
    assert "step_prefetch" not in off
    assert on["collectives_per_step"] == off["collectives_per_step"] + 1
    assert on["bytes_per_step"] == off["bytes_per_step"]
    for name in ("fsdp2-eager", "ddp-compiled", "single-compiled"):
        assert systems[name]["wait_s"] is None and systems[name]["copy_bytes_per_step"] is None


def test_graphshard_reduces_by_all_to_all_on_gloo(two_ranks):
    """On gloo the default lowers every gradient reduce-scatter to an all-to-all plus a sum;
    the rs-collective row keeps gloo's reduce-scatter. The same wire bytes are counted for
    both (what a real reduce-scatter would send), the same losses come out (world 2: the
    same bits), and only the all-to-all's sum shows up as ``grad_reduce`` traffic."""
    systems = _by_name(two_ranks[0])
    a2a, rs = systems["graphshard-compiled"], systems["graphshard-compiled-rs-collective"]
    summary_a2a, summary_rs = a2a["graphshard_summary"], rs["graphshard_summary"]
    assert summary_a2a["reduce_scatters_as_all_to_all"] == summary_a2a["reduce_scatters"] > 0
    assert summary_rs["reduce_scatters_as_all_to_all"] == 0 and summary_rs["reduce_scatters"] > 0
    assert a2a["bytes_per_step"] == rs["bytes_per_step"]
    assert a2a["loss_per_step"] == rs["loss_per_step"]
    assert summary_a2a["copy_bytes_by_category"].get("grad_reduce", 0) > 0
    assert "grad_reduce" not in summary_rs["copy_bytes_by_category"]
    # the profiler sees the all-to-alls as the summary counts them
    assert a2a["comm_profiled"]["all_to_all"] == summary_a2a["reduce_scatters"]
    assert rs["comm_profiled"]["all_to_all"] == 0
    # the eager kernels pick the same algorithm: one all-to-all per parameter, no gloo
    # reduce-scatter
    eager = systems["graphshard-eager"]["comm_profiled"]
    assert eager["all_to_all"] > 0 and eager["reduce_scatter"] == 0


def test_every_system_starts_from_the_same_loss(two_ranks):
    """Same init, same batches: the first step's loss is the same for every system (rank 0's
    for all of them, the mean over the ranks for the distributed ones)."""
    systems = [s for s in two_ranks[0]["systems"] if s["step_s_median"] is not None]
    assert len(systems) >= (7 if HAS_TORCHTITAN else 6)
    rank0 = [s["first_loss_by_rank"][0] for s in systems]
    assert max(rank0) - min(rank0) < 1e-3 * abs(rank0[0]), rank0
    mean = [s["first_loss"] for s in systems if s["system"] != "single-compiled"]
    assert max(mean) - min(mean) < 1e-3 * abs(mean[0]), mean
    final = [s["final_loss"] for s in systems if s["system"] != "single-compiled"]
    assert max(final) - min(final) < 1e-3 * abs(final[0]), final


def test_peers_run_or_say_why_not(two_ranks):
    systems = _by_name(two_ranks[0])
    prefetch = systems["fsdp2-prefetch-eager"]
    assert prefetch["collectives_per_step"] == systems["fsdp2-eager"]["collectives_per_step"]
    simple, bucketing = systems["simplefsdp-compiled"], systems["simplefsdp-block-bucketing"]
    if not HAS_TORCHTITAN:
        for s in (simple, bucketing):
            assert s["step_s_median"] is None, s
            assert s["notes"].startswith("skipped (every rank): torchtitan is not installed"), s
        return
    assert simple["step_s_median"] is not None, simple["notes"]
    assert simple["collectives_per_step"] == 2 * 21  # a gather and a reduce-scatter per param
    if HAS_TRITON or installed_torch_version() < (2, 13):
        assert bucketing["step_s_median"] is not None, bucketing["notes"]
    else:  # 2.13's overlap passes estimate runtimes with triton, which must find a GPU
        # driver (2.11's run without it): recorded, not raised, and said
        assert bucketing["step_s_median"] is None
        assert bucketing["notes"].startswith("failed (every rank): needs triton"), bucketing
        assert ("No module named 'triton'" in bucketing["notes"]
                or "0 active drivers" in bucketing["notes"]), bucketing


def test_ratios_are_taken_round_by_round(two_ranks):
    systems = _by_name(two_ranks[0])
    assert systems["graphshard-compiled"]["graphshard_ratio"]["median"] == pytest.approx(1.0)
    gs = systems["graphshard-compiled"]["round_step_s"]
    for name in ("fsdp2-eager", "ddp-compiled"):
        ratio, rounds = systems[name]["graphshard_ratio"], systems[name]["round_step_s"]
        expected = sorted(a / b for a, b in zip(gs, rounds, strict=True))
        assert ratio["rounds"] == 2 and ratio["min"] == pytest.approx(expected[0])
        assert ratio["p10"] <= ratio["median"] <= ratio["p90"] <= ratio["max"]
    bucketing = systems["simplefsdp-block-bucketing"]
    assert (bucketing["graphshard_ratio"] is None) == (bucketing["step_s_median"] is None)


# ----------------------------------------------------------------------------- fake world


def _fake_world_rows(report: dict) -> dict[str, dict]:
    """The fake world's rows that ran (SimpleFSDP's is skipped without torchtitan)."""
    systems = _by_name(report)
    assert list(systems) == FAKE_SYSTEMS
    if not HAS_TORCHTITAN:
        assert systems.pop("simplefsdp-compiled")["step_s_median"] is None
    return systems


def test_fake_world_trains_on_real_values(fake_world):
    """A gather that left zeros would pin the loss at ln(vocab) (all logits 0)."""
    report, table = fake_world
    assert report["config"]["world_size"] == 2 and "fake world of 2" in table
    assert report["config"]["compiler"] == "aot_eager"
    assert "compiled without Inductor (--compiler aot_eager" in table
    assert "AdamW (fused)," in table and report["config"]["clip_grad_norm"] is None
    clipped = {**report, "config": {**report["config"], "clip_grad_norm": 1000.0}}
    assert "AdamW (fused) after clip_grad_norm_ to 1000," in header(clipped)
    uniform = math.log(llama_config("tiny").vocab_size)
    for name, s in _fake_world_rows(report).items():
        assert s["step_s_median"] is not None, s["notes"]
        losses = s["loss_per_step"]
        assert abs(losses[0] - uniform) > 1e-3, (s, uniform)
        # the tiled model (sharded systems) learns faster than the full one at this lr
        assert losses[-1] < losses[0] - (0.05 if name in FAKE_SHARDED else 0.01), s
        if name != "single-compiled":
            assert s["collectives_per_step"] > 0 and s["bytes_per_step"] > 0, s


def test_fake_world_steps_are_also_given_without_the_collectives(fake_world):
    """On the CPU the fake groups' copies run inline; each row says how long, and the step
    without them, against one process's."""
    report, table = fake_world
    for name, s in _fake_world_rows(report).items():
        inline, compute = s["collective_s_median"], s["compute_s_median"]
        if name == "single-compiled":
            assert inline == 0.0 and compute == s["step_s_median"], s
        else:
            assert 0.0 < inline < s["step_s_median"], s
            assert compute < s["step_s_median"], s
    assert "| system | collectives ms | step without them ms | / single-compiled" in table
    assert "| single-compiled | 0.0 |" in table


def test_bf16_losses_of_every_system_stay_close(fake_world):
    """In bf16 every system trains the same way, each through its own mechanism (graphshard
    and FSDP2 and SimpleFSDP cast the gathered parameters, DDP and single-compiled run under
    autocast): the sharded systems' losses agree step by step (the tiled weights), and so
    do DDP's and single-compiled's (the full model, the same batch), to bf16's resolution."""
    report, table = fake_world
    assert report["config"]["mixed_precision"] == "bf16"
    assert "mixed precision bf16 (params and compute bf16, gradients reduced in fp32" in table
    systems = _fake_world_rows(report)
    assert not any("losses depart" in (s["notes"] or "") for s in systems.values())
    for cluster in (FAKE_SHARDED, FAKE_FULL):
        rows = [systems[name] for name in cluster if name in systems]
        reference = rows[0]["loss_per_step"]
        for s in rows[1:]:
            assert s["loss_per_step"] == pytest.approx(reference, rel=BF16_REL), (s["system"],
                                                                                  reference)


def test_bf16_gathers_half_the_bytes_and_reduces_in_fp32(fake_world):
    """Every system's collectives carry bf16 parameters and fp32 gradients: SimpleFSDP's
    one gather and one reduce-scatter per parameter send (N-1)/N * Psi * (2 + 4) bytes, and
    graphshard-compiled sends what FSDP2 sends (the same gathers, re-gathers, reductions)."""
    report, table = fake_world
    ref = report["reference"]
    assert (ref["b_param"], ref["b_reduce"]) == (2, 4) and "(2*2 + 4)" in table
    assert ref["zero3_bytes_per_rank"] == pytest.approx(0.5 * ref["params"] * (2 * 2 + 4))
    systems = _fake_world_rows(report)
    gs, fsdp = systems["graphshard-compiled"], systems["fsdp2-eager"]
    assert gs["bytes_per_step"] == fsdp["bytes_per_step"] > 0
    if "simplefsdp-compiled" in systems:
        assert systems["simplefsdp-compiled"]["bytes_per_step"] == 0.5 * ref["params"] * (2 + 4)


def test_a_variant_runs_with_its_options(fake_world):
    """Without backward re-gathers the variant gathers once per bucket, not twice: fewer
    collectives and bytes than the default (compiled graphs), the same training."""
    systems = _by_name(fake_world[0])
    default, variant = systems["graphshard-compiled"], systems[NO_RESHARD]
    gathers = [s["graphshard_summary"]["all_gathers"] for s in (default, variant)]
    assert gathers[1] < gathers[0], gathers
    assert variant["bytes_per_step"] < default["bytes_per_step"]
    assert variant["copy_bytes_per_step"] < default["copy_bytes_per_step"]
    assert variant["wait_s"] is not None
    assert variant["loss_per_step"] == pytest.approx(default["loss_per_step"], rel=1e-4)


def test_variant_options_parse_literals_and_say_what_is_wrong():
    assert variant_options("graphshard-compiled") is None
    assert variant_options("fsdp2-eager") is None
    options = variant_options(
        "graphshard-compiled[bucketing=size, bucket_bytes=8_000_000,step_prefetch=True,"
        "max_unsharded_bytes=None,reduce_scatter_via='all_to_all',reshard_after_forward=False]"
    )
    assert options == {
        "bucketing": "size", "bucket_bytes": 8_000_000, "step_prefetch": True,
        "max_unsharded_bytes": None, "reduce_scatter_via": "all_to_all",
        "reshard_after_forward": False,
    }  # fmt: skip
    bad = {
        "graphshard-compiled[]": "not option=value",
        "graphshard-compiled[bucketing]": "not option=value",
        "graphshard-compiled[a=1,a=2]": "given twice",
        "graphshard-compiled[buckting=size]": "Unknown graphshard backend option",
        "graphshard-compiled[bucketing=sz]": "bucketing must be one of",
        "graphshard-compiled[reshard_after_forward=0]": "must be True, False, auto or a positive",
        "graphshard-compiled[compile_blocks_once=auto]": "must be True or False",
        "graphshard-eager[bucketing=size]": "an eager variant takes only graphshard.shard",
    }
    for name, message in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            variant_options(name)
    assert variant_options("graphshard-compiled[reshard_after_forward=auto]") == {
        "reshard_after_forward": "auto"}
    assert variant_options("graphshard-eager[reshard_after_forward=False]") == {
        "reshard_after_forward": False}
    assert variant_options("graphshard-compiled[reshard_after_forward=8]") == {
        "reshard_after_forward": 8}


def test_systems_list_keeps_a_variants_commas():
    args = parse_args([
        "--json", "x.json", "--systems", "ddp-compiled,graphshard-compiled[bucketing=size,"
        "bucket_bytes=1000]", "graphshard-compiled",
    ])  # fmt: skip
    assert args.systems == [
        "ddp-compiled", "graphshard-compiled[bucketing=size,bucket_bytes=1000]",
        "graphshard-compiled",
    ]  # fmt: skip
    with pytest.raises(SystemExit):
        parse_args(["--json", "x.json", "--systems", "graphshard-compiled[prefetch_depth]"])


@pytest.fixture()
def fake_world_of_4():
    from bench.fake_world import init_fake_world, shutdown_fake_world

    if dist.is_initialized():  # pragma: no cover - another test left a group behind
        dist.destroy_process_group()
    init_fake_world(4)
    try:
        yield
    finally:
        shutdown_fake_world()


def test_fake_world_collectives_move_real_data(fake_world_of_4):
    world, group = 4, dist.group.WORLD
    x = torch.arange(1.0, 4.0)
    tiled = x.repeat(world)
    out = torch.full((12,), float("nan"))
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, tiled)
    full = torch.arange(12.0)
    piece = torch.full((3,), float("nan"))
    dist.reduce_scatter_tensor(piece, full)  # rank 0's piece, summed over 4 equal copies
    assert torch.equal(piece, world * full[:3])
    dist.reduce_scatter_tensor(piece, full, op=dist.ReduceOp.AVG)
    assert torch.equal(piece, full[:3])
    y = x.clone()
    dist.all_reduce(y)
    assert torch.equal(y, world * x)
    assert torch.equal(funcol.all_gather_tensor(x, 0, group).wait(), tiled)
    assert torch.equal(funcol.reduce_scatter_tensor(full, "sum", 0, group).wait(), 4 * full[:3])
    assert torch.equal(funcol.all_reduce(x, "avg", group).wait(), x)
    c10d = torch.ops._c10d_functional
    out = c10d.all_gather_into_tensor_out(x, world, group.group_name, out=torch.zeros(12))
    assert torch.equal(c10d.wait_tensor(out), tiled)

    def step(t):  # what compiled graphs call: the functional collectives and wait_tensor
        gathered = funcol.all_gather_tensor(t * 2, 0, group)
        return gathered + 1, funcol.reduce_scatter_tensor(gathered, "sum", 0, group)

    gathered, reduced = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    assert torch.equal(gathered, 2 * tiled + 1) and torch.equal(reduced, 8 * x)


def test_fake_world_groups_report_their_device(fake_world_of_4):
    """Every fake-world group registers the world's device type, as gloo registers ``cpu``
    and NCCL ``cuda``: ``_get_pg_default_device`` answers (Inductor's NCCL estimator asks it,
    torch 2.11), and the backend there supports no time estimate (the estimators fall back
    to their analytical model) and computes nothing (a collective reaching it raises)."""
    from torch.distributed import distributed_c10d as c10d

    from bench.fake_world import FakeWorldGroup

    cpu = torch.device("cpu")
    for group in (dist.group.WORLD, dist.new_group()):
        assert group._device_types == [cpu]
        assert c10d._device_capability(group) == ["cpu"]
        with pytest.warns(UserWarning, match="deprecated"):
            assert c10d._get_pg_default_device(group) == cpu
        backend = group._get_backend(cpu)
        assert backend.supports_time_estimate is False
        with pytest.raises(NotImplementedError, match="time estimator is not supported"):
            with dist.distributed_c10d._time_estimator(group=group, device=cpu):
                pass
        with pytest.raises(RuntimeError, match="error_on_collective"):
            backend.allreduce([torch.ones(2)]).wait()
        y = torch.ones(2)
        dist.all_reduce(y, group=group)  # the group's own collectives still compute
        assert torch.equal(y, torch.full((2,), 4.0))
        with pytest.raises(NotImplementedError, match="point-to-point"):
            dist.send(y, 1, group=group)
    # a CUDA fake world's groups register cuda (building one needs no GPU)
    group = FakeWorldGroup(0, 4, "cuda")
    assert group._device_types == [torch.device("cuda")]
    assert c10d._device_capability(group) == ["cuda"]
    assert group._get_backend(torch.device("cuda")).supports_time_estimate is False


def test_fake_world_gathers_the_tiled_shard(fake_world_of_4):
    """FSDP2's unshard and SimpleFSDP's parametrization see real, nonzero weights: this
    rank's shard in every rank's slot."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(dist.new_group(), "cpu")
    torch.manual_seed(0)
    fsdp = Llama(llama_config("tiny"))
    for block in fsdp.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    shards = {name: p.to_local().clone() for name, p in fsdp.named_parameters()}
    for module in [*fsdp.layers, fsdp]:
        module.unshard()
    for name, p in fsdp.named_parameters():
        assert p.abs().sum() > 0, name
        assert torch.equal(p, shards[name].repeat(4, *[1] * (p.dim() - 1))), name
    if not HAS_TORCHTITAN:  # the bench's SimpleFSDP rows are then skipped (tested above)
        return
    from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

    torch.manual_seed(0)
    simple = data_parallel(Llama(llama_config("tiny")), mesh, mode="fully_shard")
    for name, module in simple.named_modules():
        for pname, p in module._parameters.items():
            if p is None:  # a Linear's missing bias
                continue
            shard = p.to_local()
            full = getattr(module, pname)  # the parametrization: all-gathered
            assert full.abs().sum() > 0, (name, pname)
            assert torch.equal(full, shard.repeat(4, *[1] * (shard.dim() - 1))), (name, pname)
            assert torch.equal(shard, shards[f"{name}.{pname}"]), (name, pname)


# ----------------------------------------------------------------------------- pure functions


def test_missing_torchtitan_is_a_clear_skip(monkeypatch):
    from bench import systems

    monkeypatch.setitem(sys.modules, "torchtitan.experiments.graph_trainer.simple_fsdp", None)
    ctx = BenchContext(llama_config("tiny"), 0, 1e-3, torch.device("cpu"), 2)
    with pytest.raises(PeerUnavailable, match="torchtitan is not installed"):
        systems._simple_fsdp(ctx, None, "simplefsdp-compiled")
    _, entry = _attempt(systems._simple_fsdp, ctx, None, "simplefsdp-compiled")
    record = summarize("simplefsdp-compiled", [entry, entry], 1)
    assert record["step_s_median"] is None and record["bytes_per_step"] is None
    assert record["notes"].startswith("skipped (every rank): torchtitan is not installed")
    assert "pip install" in record["notes"]


def test_offload_systems_run_when_named_and_skip_on_the_cpu():
    """The CPU-offload rows (graphshard's and FSDP2's, and variants of graphshard's compiled
    one) are accepted by ``--systems`` but not in the default list, and on the CPU each is a
    clear skip, before any process group."""
    from bench.systems import OFFLOAD_SYSTEMS, SYSTEMS, build_system

    assert set(OFFLOAD_SYSTEMS).isdisjoint(SYSTEMS)
    assert not set(OFFLOAD_SYSTEMS) & set(parse_args(["--json", "x.json"]).systems)
    named = parse_args(["--json", "x.json", "--systems", *OFFLOAD_SYSTEMS])
    assert named.systems == list(OFFLOAD_SYSTEMS)
    ctx = BenchContext(llama_config("tiny"), 0, 1e-3, torch.device("cpu"), 2)
    variant = "graphshard-offload-compiled[reshard_after_forward=False]"
    assert parse_args(["--json", "x.json", "--systems", variant]).systems == [variant]
    assert variant_options(variant) == {"reshard_after_forward": False}
    for name in (*OFFLOAD_SYSTEMS, variant):
        with pytest.raises(PeerUnavailable, match="--device cuda"):
            build_system(name, ctx)  # no process group here: the skip comes first


def test_failed_system_has_null_numbers_and_the_error():
    record = summarize("fsdp2-eager", [{"error": "RuntimeError: boom"}, {"idle": True}], 1)
    assert set(FIELDS) <= set(record)
    assert record["step_s_median"] is None and record["bytes_per_step"] is None
    assert record["notes"] == "failed; rank 0: RuntimeError: boom"
    same = summarize("x", [{"error": "E: boom"}, {"error": "E: boom"}], 1)
    assert same["notes"] == "failed (every rank): E: boom"
    add_ratios([record, same])
    assert record["graphshard_ratio"] is None


def test_a_system_whose_first_losses_depart_from_its_groups_is_noted():
    """Systems that train the same model on the same batches agree to rounding; one that
    does not gets a note naming the step, and the groups (distributed, one process) and the
    precision's tolerance are kept apart."""
    base = [7.6643, 7.4164, 7.04, 6.712, 6.4065]

    def rec(name, losses, notes=None):
        return {"system": name, "loss_per_step": losses, "notes": notes}

    rounded = [x * (1 + 1e-5) for x in base]
    wrong = [7.6643, 7.3498, 7.0747, 6.7536, 6.4148]  # wrong block gradients from step 1 on
    records = [rec("ddp-compiled", rounded), rec("graphshard-compiled", base),
               rec("fsdp2-eager", wrong), rec("single-compiled", [x + 0.5 for x in base]),
               rec("single-regions-compiled", [x + 0.5 for x in wrong], "kept"),
               rec("simplefsdp-auto-bucketing", None, "failed")]
    add_loss_checks(records, frozenset({"single-compiled", "single-regions-compiled"}))
    notes = {r["system"]: r["notes"] for r in records}
    assert notes["ddp-compiled"] is None and notes["graphshard-compiled"] is None
    assert notes["single-compiled"] is None and notes["simplefsdp-auto-bucketing"] == "failed"
    assert notes["fsdp2-eager"].startswith(
        "losses depart from graphshard-compiled's: step 2 7.3498 against 7.4164")
    assert notes["single-regions-compiled"].startswith("kept; losses depart from single-compiled's")
    assert records[2]["loss_departure"]["step"] == 2

    mixed = [rec("graphshard-compiled", base), rec("ddp-compiled", [x * 1.005 for x in base])]
    add_loss_checks(mixed, frozenset(), "bf16")  # within mixed precision's rounding
    assert mixed[1]["notes"] is None
    add_loss_checks(mixed, frozenset())  # not within fp32's
    assert "relative 5.0e-03" in mixed[1]["notes"]

    diverged = [rec("graphshard-compiled", base), rec("ddp-compiled", [*base[:3], math.nan, 1.0]),
                rec("fsdp2-eager", [math.nan] * 5), rec("fsdp2-compiled", [math.nan] * 5)]
    add_loss_checks(diverged, frozenset())
    assert "step 4 nan against 6.7120" in diverged[1]["notes"]
    assert "step 1 nan" in diverged[2]["notes"]
    assert diverged[3]["notes"].startswith("losses depart")  # compared with the reference only


def test_in_a_fake_world_ddp_is_checked_against_one_process_not_the_sharded_systems():
    """A fake world's sharded systems train rank 0's shards tiled, while DDP trains the whole
    model on rank 0's batch as one process does (first losses of a fake world of 2, fp32,
    tiny): neither group is noted there, and in a real world DDP is a distributed system."""
    from bench.systems import ONE_PROCESS_SYSTEMS, trains_alone

    tiled = [5.55561, 5.53936, 5.477, 5.49478, 5.43874]
    whole = [5.55179, 5.48683, 5.39098, 5.41089, 5.31107]

    def records():
        return [{"system": name, "loss_per_step": losses, "notes": None}
                for name, losses in (("graphshard-compiled", tiled), ("fsdp2-eager", tiled),
                                     ("ddp-compiled", whole), ("single-compiled", whole))]

    fake = records()
    add_loss_checks(fake, trains_alone(True))
    assert [r["notes"] for r in fake] == [None] * 4
    assert trains_alone(False) == ONE_PROCESS_SYSTEMS
    real = records()
    add_loss_checks(real, trains_alone(False))
    assert real[2]["notes"].startswith("losses depart from graphshard-compiled's")


def test_steps_without_inline_collectives_are_taken_step_by_step():
    rank = {"times": [9.0, 1.0, 2.0, 3.0, 4.0], "rounds": [-1, 0, 0, 1, 1],
            "collective_times": [5.0, 0.5, 0.5, 1.0, 3.0], "notes": [], "losses": [1.0] * 5,
            "peak_mem_bytes": 0, "comm": None}
    stats = inline_collective_stats([rank], warmup=1)
    assert stats == {"collective_s_median": 0.75, "compute_s_median": 1.25,
                     "round_compute_s": [1.0, 1.5]}
    assert inline_collective_stats([{**rank, "collective_times": []}], warmup=1) == {}
    alone = {**rank, "collective_times": [0.0] * 5}
    records = [{"system": "x", **stats},
               {"system": "single-compiled", **inline_collective_stats([alone], warmup=1)}]
    lines = fake_world_lines(records)
    assert "| x | 750.0 | 1,250.0 | 0.55 (0.43-0.67) |" in lines  # 1.0/1.5 and 1.5/3.5
    assert fake_world_lines([{"system": "x", "compute_s_median": None}]) == []


def test_fake_world_groups_time_their_collectives(fake_world_of_4):
    before = collective_seconds()
    torch.ones(1 << 20).mul_(2)  # not a collective: not counted
    assert collective_seconds() == before
    out = torch.empty(4 << 20)
    dist.all_gather_into_tensor(out, torch.ones(1 << 20))
    gathered = collective_seconds()
    assert gathered > before
    funcol.reduce_scatter_tensor(out, "sum", 0, dist.group.WORLD).wait()  # compiled graphs' op
    assert collective_seconds() > gathered


def test_round_ratios():
    ratio = round_ratios([1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 2.0])
    assert ratio == {"median": 1.25, "p10": 0.5, "p90": 2.0, "min": 0.5, "max": 2.0, "rounds": 4}
    assert round_ratios([], [1.0]) is None


def test_describe_exception_names_the_raising_frames():
    def innermost():
        raise ModuleNotFoundError("No module named 'triton'")

    try:
        innermost()
    except ModuleNotFoundError as exc:
        text = describe_exception(exc)
    assert text.startswith("ModuleNotFoundError: No module named 'triton' (raised in ")
    assert "test_bench.py:innermost <- " in text


class _Event:
    """A profiler event as torch 2.11 records it: flat ``shapes``, no structured ones."""

    def __init__(self, name: str, shapes: list, dtypes: list[str]) -> None:
        self._name, self._shapes, self._dtypes = name, shapes, dtypes

    def name(self) -> str:
        return self._name

    def shapes(self) -> list:
        return self._shapes

    def dtypes(self) -> list[str]:
        return self._dtypes


def test_count_collectives_on_torch_without_structured_shapes():
    events = [
        _Event("c10d::_allgather_base_", [[8, 4], [4, 4], [], []], ["float", "float", "", ""]),
        _Event("c10d::allreduce_", [[], [], []], ["TensorList", "", ""]),
        _Event("aten::mm", [[2, 2]], ["float"]),
    ]
    comm = count_collectives(events, world_size=2, default_elem=4)
    assert comm["all_gather"] == 1 and comm["all_reduce"] == 1 and comm["total"] == 2
    assert comm["bytes"] == 8 * 4 * 4 // 2  # the gather; the list all-reduce is unsized
    assert comm["unsized"] == 1


def test_gloo_reduce_scatter_counts_as_the_all_reduce_it_is():
    """gloo's reduce-scatter all-reduces the whole input: 2(N-1)/N of it on the wire, as
    much as an all-reduce; an all-to-all sends the (N-1)/N of its input that leaves."""
    events = [
        _Event("c10d::_reduce_scatter_base_", [[4, 4], [8, 4], [], []],
               ["float", "float", "", ""]),
        _Event("c10d::alltoall_base_", [[8, 4], [8, 4], [], [], []],
               ["float", "float", "", "", ""]),
    ]
    ring = count_collectives(events, world_size=2, default_elem=4)
    gloo = count_collectives(events, world_size=2, default_elem=4, gloo=True)
    assert ring["reduce_scatter"] == ring["all_to_all"] == 1 and ring["total"] == 2
    assert ring["bytes"] == 8 * 4 * 4 // 2 + 8 * 4 * 4 // 2
    assert gloo["bytes"] == 8 * 4 * 4 + 8 * 4 * 4 // 2


def test_llama_1b_preset_is_about_a_billion_parameters():
    """The GPU-sized preset (built on the meta device: nothing allocated)."""
    cfg = llama_config("llama-1b")
    assert (cfg.dim, cfg.n_layers, cfg.vocab_size) == (2048, 16, 32768)
    with torch.device("meta"):
        model = Llama(cfg)
    assert model.num_params() == 1_107_363_840
    assert parse_args(["--json", "x.json", "--model", "llama-1b", "--seq-len", "2048"]).model == (
        "llama-1b"
    )


def test_every_model_runs_with_the_default_sequence_length_and_no_json():
    """``--seq-len`` defaults to 128 or the model's longest where shorter (tiny: 64), and
    ``--json`` is optional: ``python -m bench.step --model tiny`` parses as it is."""
    assert parse_args(["--model", "tiny"]).seq_len == 64
    assert parse_args([]).seq_len == 128 and parse_args([]).json is None
    for model in CONFIGS:
        assert 2 <= parse_args(["--model", model]).seq_len <= llama_config(model).max_seq_len


def test_mixed_precision_option_reaches_every_system():
    from bench.systems import MIXED_PRECISION

    assert parse_args(["--json", "x.json"]).mixed_precision == "none"
    for name, dtype in (("none", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        assert parse_args(["--json", "x.json", "--mixed-precision", name]).mixed_precision == name
        ctx = BenchContext(llama_config("tiny"), 0, 1e-3, torch.device("cpu"), 2,
                           mixed_precision=name)
        assert ctx.param_dtype is dtype and MIXED_PRECISION[name] is dtype
    with pytest.raises(SystemExit):
        parse_args(["--json", "x.json", "--mixed-precision", "fp8"])


def test_compiler_option_takes_inductor_out_of_every_compiled_system(one_rank, monkeypatch):
    """``--compiler aot_eager``: graphshard's backend runs without Inductor (a variant's own
    ``inductor=`` still wins), the peers compile with AOTAutograd alone (a step runs with
    Inductor's backend made to fail), and SimpleFSDP's bucketing rows say their pass did
    not run."""
    from bench.systems import _OwnInductor, build_system
    from bench.timing import train_step

    assert parse_args(["--json", "x.json"]).compiler == "inductor"
    with pytest.raises(SystemExit):
        parse_args(["--json", "x.json", "--compiler", "eager"])
    cfg = llama_config("tiny", n_layers=1)
    ctx = BenchContext(cfg, 0, 1e-3, torch.device("cpu"), 1, compiler="aot_eager")
    assert build_system("graphshard-compiled", ctx).backend.inductor is False
    assert build_system("graphshard-compiled[inductor=True]", ctx).backend.inductor is True
    inductor = BenchContext(cfg, 0, 1e-3, torch.device("cpu"), 1)
    assert build_system("graphshard-compiled", inductor).backend.inductor is True

    def refuse(*args, **kwargs):
        raise AssertionError("Inductor compiled a graph under --compiler aot_eager")

    monkeypatch.setattr(_OwnInductor, "__call__", refuse)
    tokens = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    for name in ("single-compiled", "ddp-compiled"):
        torch._dynamo.reset()
        assert torch.isfinite(train_step(build_system(name, ctx), tokens)), name
    if HAS_TORCHTITAN:
        bucketing = build_system("simplefsdp-block-bucketing", ctx)
        assert any("an Inductor pass: not run with --compiler aot_eager" in note
                   for note in bucketing.notes), bucketing.notes
        assert not build_system("simplefsdp-block-bucketing", inductor).notes


def test_autocast_runs_the_forward_in_the_systems_dtype():
    """DDP's and single-compiled's mixed precision: the forward and the loss under
    ``torch.autocast``, the backward and the optimizer step outside it (fp32 gradients on
    fp32 parameters)."""
    from bench.systems import System
    from bench.timing import train_step

    torch.manual_seed(0)
    model = Llama(llama_config("tiny"))
    seen: list[torch.dtype] = []

    def run(tokens: torch.Tensor):
        out = model(tokens)
        seen.append(out.logits.dtype)
        return out

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grads: list[torch.dtype] = []  # the gradients' dtypes when the optimizer steps
    optimizer.register_step_pre_hook(
        lambda opt, *_: grads.extend(p.grad.dtype for p in model.parameters())
    )
    for dtype in (None, torch.bfloat16, torch.float16):
        seen.clear()
        grads.clear()
        system = System("x", run, model, optimizer, distributed=False, autocast=dtype)
        loss = train_step(system, torch.randint(0, 256, (2, 16)))
        assert seen == [dtype or torch.float32] and loss.dtype == torch.float32
        assert set(grads) == {torch.float32}


def test_clip_grad_norm_option_clips_between_backward_and_the_step():
    """``--clip-grad-norm``: every system's step clips its gradients' global norm to the
    threshold before the optimizer steps; without it they are left alone."""
    from bench.systems import System
    from bench.timing import train_step

    assert parse_args(["--json", "x.json"]).clip_grad_norm is None
    assert parse_args(["--json", "x.json", "--clip-grad-norm", "0.5"]).clip_grad_norm == 0.5
    torch.manual_seed(0)
    model = Llama(llama_config("tiny"))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    norms: list[float] = []  # the gradients' global norm when the optimizer steps
    optimizer.register_step_pre_hook(lambda opt, *_: norms.append(
        torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()))
    for threshold in (None, 1e-3):
        system = System("x", model, model, optimizer, distributed=False,
                        clip_grad_norm=threshold)
        train_step(system, torch.randint(0, 256, (2, 16)))
    assert norms[0] > 1e-2 and norms[1] == pytest.approx(1e-3, rel=1e-3), norms
    clips = []  # a system's own clip (graphshard's systems: graphshard.clip_grad_norm_)
    system = System("x", model, model, optimizer, distributed=False, clip_grad_norm=0.5,
                    clip=lambda params, max_norm: clips.append(max_norm))
    train_step(system, torch.randint(0, 256, (2, 16)))
    assert clips == [0.5]


def test_block_bucket_plans_follow_graph_trainer():
    model = Llama(llama_config("tiny"))
    plans = ["tok_embeddings", ["norm", "output"], "layers.0", "layers.1"]
    assert block_bucket_plans(model) == plans


def test_optimizer_bench_times_every_adamw_on_shards_and_plain(capsys):
    from bench import optimizer

    if dist.is_initialized():  # pragma: no cover - another test left a group behind
        dist.destroy_process_group()
    result = optimizer.main(["--world-size", "2", "--model", "tiny", "--steps", "2",
                             "--rounds", "2"])
    assert not dist.is_initialized()
    for where in ("sharded", "plain"):
        assert set(result[where]) == set(optimizer.IMPLEMENTATIONS)
        assert all(ms > 0 for ms in result[where].values()), result
    # torch's fused CPU kernel on graphshard's DTensor shards: the loop's result, rounded
    # differently
    assert 0 <= result["fused_vs_loop_max_abs_diff"] < 1e-6, result
    assert result["fused_dtensor_dispatch_ms"] > 0, result
    assert set(result["clip_ms"]) == {"sharded", "plain"}, result
    assert min(result["clip_ms"].values()) > 0 and result["clip_dtensor_dispatch_ms"] > 0
    assert result["clip_graphshard_ms"] > 0
    table = capsys.readouterr().out
    assert "clip_grad_norm_: sharded" in table
    assert "| sharded |" in table and "| plain |" in table and "fused ms" in table
    assert "through DTensor's dispatch" in table
    with pytest.raises(SystemExit):
        optimizer.parse_args(["--world-size", "1"])


def test_optimizer_option_reaches_every_systems_adamw():
    from bench.systems import _adamw

    model = torch.nn.Linear(2, 2)
    for name, foreach, fused in (("default", None, None), ("loop", False, None),
                                 ("foreach", True, None), ("fused", None, True)):
        ctx = BenchContext(llama_config("tiny"), 0, 1e-3, torch.device("cpu"), 2, name)
        defaults = _adamw(model, ctx).defaults
        assert (defaults["foreach"], defaults["fused"]) == (foreach, fused), name
    assert parse_args(["--json", "x.json"]).optimizer == "default"
    with pytest.raises(SystemExit):
        parse_args(["--json", "x.json", "--optimizer", "adam"])


def test_single_regions_compiled_compiles_one_block_body_for_every_layer():
    """The regional-compilation floor: the unsharded model whose blocks are one
    ``nested_compile_region``. Dynamo's graph calls one body for every layer, and the compiled
    steps train as the plain model does: the same losses and, after two steps, the same
    parameters (Inductor's in-place buffers gave the blocks wrong weight gradients)."""
    from bench.systems import ONE_PROCESS_SYSTEMS, build_system
    from bench.timing import train_step

    cfg = llama_config("tiny", n_layers=3)
    ctx = BenchContext(cfg, 0, 1e-3, torch.device("cpu"), 2)
    system = build_system("single-regions-compiled", ctx)
    assert "single-regions-compiled" in ONE_PROCESS_SYSTEMS and not system.distributed
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    torch.compile(system.module, backend=capture)(tokens)
    calls = [n for g in graphs for n in g.graph.nodes
             if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == cfg.n_layers
    assert len({n.args[0].target for n in calls}) == 1  # one body, called for every layer

    torch.manual_seed(ctx.seed)
    plain = Llama(cfg)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=ctx.lr)
    for _ in range(2):
        expected = plain(tokens).loss
        expected.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert torch.allclose(train_step(system, tokens), expected, rtol=1e-5, atol=1e-6)
    for (name, mine), theirs in zip(system.module.named_parameters(), plain.parameters(),
                                    strict=True):
        assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-6), name


def _main_in_its_own_process(module: str, argv: list[str]) -> tuple[str, Any]:
    """``bench.<module>.main(argv)`` run by a fresh Python: its printed output, and what it
    returned (through JSON)."""
    import subprocess
    from pathlib import Path

    code = (f"import json, bench.{module} as m; "
            f"print('RESULT', json.dumps(m.main({argv!r})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return done.stdout, json.loads(line.removeprefix("RESULT "))


def test_offload_prediction_refuses_a_sequence_longer_than_the_model():
    from bench.offload_predict import main

    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--seq-len", "65"])
    with pytest.raises(SystemExit):
        main(["--model", "no-such-preset"])


def test_offload_prediction_prices_the_copies_and_their_streams():
    """``python -m bench.offload_predict`` (its own process: it registers a stand-in
    accelerator) prints one row per setting. On a model whose copies outweigh its compute,
    the copy streams hide part of them, and keeping the gathered parameters sends fewer
    bytes over the host link."""
    out, result = _main_in_its_own_process(
        "offload_predict", ["--model", "tiny", "--batch-size", "2", "--seq-len", "16"])
    assert "| copy streams (default) |" in out
    rows = {r["setting"]: r for r in result}
    total = {name: r["fw"] + r["bw"] for name, r in rows.items()}
    serial, streams = rows["compute stream"], rows["copy streams (default)"]
    assert total["copy streams (default)"] < total["compute stream"]
    assert streams["exposed_copy"] > 0 == serial["exposed_copy"]
    assert rows['"auto", compute stream']["copy_time"] < serial["copy_time"]
    assert serial["compute_time"] < serial["copy_time"]


def test_gather_floor_times_real_gathers_alone_and_beside_compute():
    """``python -m bench.gather_floor`` gathers real shards on two gloo ranks (every rank's
    values arrive in their place) and reports the three timings and what the overlap hid."""
    out, report = _main_in_its_own_process(
        "gather_floor", ["--shard-mb", "0.01", "--count", "3", "--rounds", "2", "--warmup", "1",
                         "--matmuls", "1"])
    assert "3 gathers of 0.01 MB shards at world 2:" in out
    assert report["exact"] is True
    assert all(report[key] > 0 for key in ("gathers_ms", "compute_ms", "overlapped_ms"))
    assert report["hidden_ms"] == pytest.approx(
        report["gathers_ms"] + report["compute_ms"] - report["overlapped_ms"])


@pytest.mark.parametrize("plain", [False, True], ids=["sharded", "plain"])
def test_guard_check_measures_alone_and_after_another_compile(capsys, plain):
    from bench import guard_check

    if dist.is_initialized():  # pragma: no cover - another test left a group behind
        dist.destroy_process_group()
    # Without Inductor: Dynamo's guards are the same, and each Inductor compile of the model
    # would cost the suite about a minute.
    argv = ["--model", "tiny", "--steps", "2", "--rounds", "2", "--no-inductor"] + (
        ["--plain"] if plain else [])
    result = guard_check.main(argv)
    torch._dynamo.reset()
    assert not dist.is_initialized()
    assert result["system"] == ("plain" if plain else "graphshard")
    assert result["inductor"] is False
    assert result["leaf_guards"] > 100, result
    for key in ("lookup_ms_alone", "lookup_ms_after_another_compile"):
        assert len(result[key]) == 2 and all(ms > 0 for ms in result[key]), result
    assert "ms after another compile" in capsys.readouterr().out


def test_the_generation_bench_decodes_the_same_tokens_with_every_system(tmp_path):
    """``python -m bench.generate`` on two gloo ranks: every system (graphshard gathering
    per call or holding with ``graphshard.unshard``, FSDP2 per call or after its
    ``unshard()``, one process) decodes one process's tokens, and the report says so."""
    from bench import generate

    out = tmp_path / "generate.json"
    records = generate.main(["--world-size", "2", "--model", "tiny", "--new-tokens", "2",
                             "--rounds", "1", "--json", str(out), "--markdown",
                             str(tmp_path / "generate.md")])
    assert [r["system"] for r in records] == list(generate.SYSTEMS)
    assert all(r["tokens_match_single"] for r in records), records
    assert all(r["s_per_token_median"] > 0 for r in records)
    reference = next(r for r in records if r["system"] == generate.REFERENCE)
    assert reference["reference_ratio_median"] == 1.0
    assert json.loads(out.read_text()) == records
    assert "| graphshard-unshard |" in (tmp_path / "generate.md").read_text()
