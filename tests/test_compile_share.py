"""One compilation for N ranks (``share_compiled``): the first rank to reach a graph compiles
it and publishes the artifacts through the store; the others load them, unless what they
find is partial or corrupted, in which case they compile themselves.

The protocol is tested in one process on a ``HashStore`` (two ``CompileShare`` objects play
two ranks); one launch of two real gloo ranks, each with its own empty Inductor cache, checks
that rank 1 compiles nothing for a graph rank 0 published, compiles everything itself when
the published artifacts are corrupted, and computes the same numbers either way; then, on
one directory for both, that the rank which waited for the whole graph is answered by
AOTAutograd's cache and runs no pass.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from graph_utils import fake_process_group

import graphshard
from graphshard.compiler import share as share_mod
from graphshard.compiler.share import CompileShare, decode, encode
from graphshard.errors import GraphshardTypeError
from graphshard.models.llama import Llama, llama_config


def test_frames_reject_truncation_and_corruption():
    blob = encode(b"artifacts" * 100)
    assert decode(blob) == b"artifacts" * 100
    assert decode(blob[:-1]) is None  # partial write
    assert decode(blob[:10]) is None
    flipped = bytearray(blob)
    flipped[-5] ^= 0xFF
    assert decode(bytes(flipped)) is None  # corruption
    assert decode(b"") is None


class _Graph:
    code = "def forward(self, x): return x"
    graph = torch.fx.Graph()  # no region call, no symbolic input


@pytest.fixture
def fake_cache(monkeypatch):
    """torch.compiler's artifact save/load replaced by a record of what was loaded."""
    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled!", None))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)
    # the two "ranks" of these tests live in one process: by default they play ranks with
    # cache directories of their own (an unknown directory is never taken for a shared one)
    monkeypatch.setattr(share_mod, "cache_dir_identity", lambda: None)
    return loaded


def _pair(timeout_s: float = 5.0) -> tuple[CompileShare, CompileShare]:
    store = dist.HashStore()
    return CompileShare(store, 0, timeout_s), CompileShare(store, 1, timeout_s)


def test_the_second_rank_loads_what_the_first_published(fake_cache):
    first, second = _pair()
    inputs = [torch.zeros(2, 3)]
    assert first.compile(_Graph(), inputs, lambda: "fw0") == "fw0"
    assert second.compile(_Graph(), inputs, lambda: "fw1") == "fw1"  # a cache hit after load
    assert fake_cache == [b"compiled!"]
    assert (first.stats.published, second.stats.loaded, second.stats.compiled_alone) == (1, 1, 0)


def test_different_graphs_never_wait_for_each_other(fake_cache):
    first, second = _pair(timeout_s=60)
    first.compile(_Graph(), [torch.zeros(2, 3)], lambda: None)
    second.compile(_Graph(), [torch.zeros(4, 3)], lambda: None)  # other shape: claims its own
    assert fake_cache == [] and second.stats.published == 1


def test_corrupted_artifacts_are_ignored(fake_cache, monkeypatch):
    first, second = _pair()
    monkeypatch.setattr(share_mod, "encode", lambda payload: encode(payload)[:-1] + b"?")
    first.compile(_Graph(), [], lambda: None)
    second.compile(_Graph(), [], lambda: None)
    assert fake_cache == [] and second.stats.compiled_alone == 1
    assert "corrupted" in second.stats.reasons[0]


def test_a_publisher_that_died_mid_write_is_not_loaded(fake_cache):
    first, second = _pair(timeout_s=0.2)
    digest = share_mod.graph_digest(_Graph(), [])
    first.store.add(first._key(digest, "claim"), 1)  # claimed ...
    first.store.set(first._key(digest, "data"), encode(b"compiled!")[:7])  # ... half-written
    assert second.compile(_Graph(), [], lambda: "own") == "own"
    assert fake_cache == []
    assert second.stats.reasons == ["waited 0.2 s for another rank's published artifacts"]


def test_a_failed_compile_releases_the_waiters_at_once(fake_cache):
    first, second = _pair(timeout_s=60)

    def fails():
        raise RuntimeError("inductor failed")

    with pytest.raises(RuntimeError):
        first.compile(_Graph(), [], fails)
    second.compile(_Graph(), [], lambda: None)
    assert second.stats.reasons == ["its publisher failed"]


def test_ranks_that_share_a_cache_directory_load_nothing(fake_cache, monkeypatch):
    monkeypatch.setattr(share_mod, "cache_dir_identity", lambda: "boot:1:2:/cache")
    first, second = _pair()
    first.compile(_Graph(), [], lambda: None)
    assert second.compile(_Graph(), [], lambda: "hit") == "hit"
    assert fake_cache == []  # the publisher's entries are in that directory already
    assert (second.stats.loaded, second.stats.same_cache_dir) == (1, 1)
    monkeypatch.setattr(share_mod, "cache_dir_identity", lambda: "boot:1:3:/other")
    third = CompileShare(first.store, 2, 5.0)
    third.compile(_Graph(), [], lambda: None)  # another directory: it loads
    assert fake_cache == [b"compiled!"] and third.stats.same_cache_dir == 0


def test_by_default_only_ranks_of_one_cache_directory_meet_and_nothing_travels(
        fake_cache, monkeypatch, tmp_path):
    """``share_compiled="auto"`` (``transfer=False``): a rank of one directory that reaches
    the graph while the first one compiles it waits, then hits what it wrote; a rank of
    another directory neither waits for them nor loads anything (it compiles, first in its
    own directory), and nothing is published through the store."""
    import threading

    store = dist.HashStore()
    saved: list[int] = []
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts",
                        lambda: saved.append(1) or (b"compiled!", None))
    ranks = [CompileShare(store, r, 5.0, transfer=False) for r in range(3)]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "host"))
    monkeypatch.setattr(share_mod, "cache_dir_identity", lambda: "boot:1:2:/host")
    claim = ranks[0]._key(share_mod.graph_digest(_Graph(), []),
                          f"graph/{share_mod.hashlib.sha256(b'boot:1:2:/host').hexdigest()[:16]}"
                          "/claim")
    results = {}
    second = threading.Thread(
        target=lambda: results.update({1: ranks[1].compile(_Graph(), [], lambda: "rank1")}))

    def rank0_compiles() -> str:  # rank 1 arrives while rank 0 compiles, and claims in vain
        second.start()
        deadline = time.monotonic() + 10
        while store.add(claim, 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        return "rank0"

    results[0] = ranks[0].compile(_Graph(), [], rank0_compiles)
    second.join(10)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setattr(share_mod, "cache_dir_identity", lambda: "boot:9:9:/elsewhere")
    results[2] = ranks[2].compile(_Graph(), [], lambda: "rank2")
    assert results == {0: "rank0", 1: "rank1", 2: "rank2"}
    assert [(s.stats.published, s.stats.loaded, s.stats.same_cache_dir) for s in ranks] == \
        [(1, 0, 0), (0, 1, 1), (1, 0, 0)]
    assert fake_cache == [] and saved == []  # nothing serialised, nothing loaded
    assert not any(s.stats.compiled_alone for s in ranks)


def test_a_shared_cache_directory_is_recognised(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "shared"))
    here = share_mod.cache_dir_identity()  # Inductor's cache_dir() makes the directory
    assert here is not None
    (tmp_path / "link").symlink_to(tmp_path / "shared")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "link"))
    assert share_mod.cache_dir_identity() == here  # the same directory by another name
    (tmp_path / "other").mkdir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "other"))
    assert share_mod.cache_dir_identity() != here


def test_the_rank_beside_the_publisher_hits_its_cache_without_loading(tmp_path, monkeypatch):
    """Real Inductor, one process playing both ranks of one host: one cache directory. The
    second rank must not load the payload (``load_cache_artifacts`` would rewrite every entry
    the publisher ever recorded into the directory both compile and load kernels from) and
    still compiles nothing: its Inductor hits what the publisher wrote there."""
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    loads: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loads.append)
    first, second = _pair()
    x = torch.randn(8)
    hits, misses = (counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss"))
    outs = []
    for share in (first, second):
        torch._dynamo.reset()

        def backend(gm, inputs, share=share):
            return share.compile(gm, inputs, lambda: compile_fx(gm, inputs))

        outs.append(torch.compile(lambda t: (t.sin() * 3).cos().sum(), backend=backend)(x))
    torch._dynamo.reset()
    assert loads == []
    assert (first.stats.published, second.stats.loaded, second.stats.same_cache_dir) == (1, 1, 1)
    assert counters["inductor"]["fxgraph_cache_miss"] - misses == 1  # the publisher's compile
    assert counters["inductor"]["fxgraph_cache_hit"] - hits == 1  # the second rank's
    assert torch.equal(outs[0], outs[1])


def test_each_payload_holds_its_own_graph_and_the_users_record_keeps_all(tmp_path,
                                                                          monkeypatch):
    """``share_compiled=True``, real Inductor: each published payload holds the artifacts of
    its own graph only (``save_cache_artifacts`` is cumulative: the second graph's payload
    would carry the first graph again, O(graphs^2) bytes for a job), and the process's own
    record, which a user's ``save_cache_artifacts`` serialises, still holds every graph
    (publishing with the process's record moved its artifacts into segments that torch's
    loader then drops: a user's mega-cache lost all but the last graph)."""
    from torch._inductor.compile_fx import compile_fx
    from torch.compiler import _cache as cache_mod
    from torch.compiler._cache import CacheArtifactManager
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(share_mod, "cache_dir_identity", lambda: None)
    loaded: list[bytes] = []
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", loaded.append)

    def inductor_keys(payload: bytes) -> set[str]:
        """Every Inductor entry the bytes hold (segment by segment: torch's own
        ``deserialize`` keeps only the last segment of each kind)."""
        CacheArtifactManager._ensure_cache_artifacts_registered()
        segments = AppendingByteSerializer.to_list(
            payload, deserialize_fn=cache_mod._deserialize_single_cache)
        return {artifact.key for kind, artifacts in segments if kind == "inductor"
                for artifact in artifacts}

    def compile_on(share: CompileShare, fn: Any) -> torch.Tensor:
        def backend(gm, inputs):
            return share.compile(gm, inputs, lambda: compile_fx(gm, inputs))

        return torch.compile(fn, backend=backend)(torch.randn(8))

    functions = [lambda t: (t.sin() * 3).cos().sum(), lambda t: (t.exp() + 1).relu().sum()]
    torch._dynamo.reset()
    with CacheArtifactManager.with_fresh_cache():  # what the user's process records
        publisher, loader = _pair()
        for fn in functions:
            compile_on(publisher, fn)
        users = torch.compiler.save_cache_artifacts()
        torch._dynamo.reset()
        for fn in functions:
            compile_on(loader, fn)
    torch._dynamo.reset()
    assert (publisher.stats.published, loader.stats.loaded) == (2, 2)
    first, second = (inductor_keys(payload) for payload in loaded)  # what the loader got
    assert len(first) == len(second) == 1 and first != second
    assert first | second <= inductor_keys(users[0])


def test_options_are_checked():
    import graphshard

    with pytest.raises(GraphshardTypeError):
        graphshard.backend(share_compiled="yes")
    with pytest.raises(GraphshardTypeError):
        graphshard.backend(share_timeout_s=-1)
    assert graphshard.backend(share_compiled=False).share_compiled is False
    assert graphshard.backend().share_compiled == "auto"


def _two_models(seed: int, dims: tuple[int, int, int]) -> torch.nn.Module:
    torch.manual_seed(seed)
    a, b, c = dims
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.GELU(), torch.nn.Linear(b, c))


def _run(model: torch.nn.Module, x: torch.Tensor, compiled: bool,
         share_compiled: bool | str = True):
    import graphshard

    graphshard.shard(model)
    # True: artifacts travel between cache directories; "auto" (the default): ranks of one
    # directory meet there
    backend = graphshard.backend(share_compiled=share_compiled)
    run = torch.compile(model, backend=backend) if compiled else model
    loss = run(x).square().mean()
    loss.backward()
    grads = [p.grad.full_tensor().clone() for p in model.parameters()]
    return loss.detach(), grads, backend


def _counts() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics, counters

    counts = {k: counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")}
    # seconds in the C++ compiler (reported in the failure message, not asserted)
    counts["compile_file_s"] = sum(compilation_time_metrics.get("compile_file", []))
    return counts


def _shared_compile_job(rank: int, world_size: int, root: str) -> dict:
    # an empty Inductor cache of its own (under the test's directory, which pytest removes):
    # a hit can only come from what rank 0 published
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix=f"share_rank{rank}_", dir=root)
    torch.manual_seed(123)
    x = torch.randn(4, 16)
    result: dict = {}
    for name, dims, corrupt in (("good", (16, 24, 8), False), ("corrupt", (16, 40, 12), True)):
        if corrupt:  # on both: whichever rank reaches the graph first publishes
            share_mod.encode = lambda payload: encode(payload)[:-3] + b"bad"
        before = _counts()
        loss, grads, backend = _run(_two_models(0, dims), x, compiled=True)
        after = _counts()
        ref_loss, ref_grads, _ = _run(_two_models(0, dims), x, compiled=False)
        stats = backend.share.stats
        result[name] = {
            "delta": {k: after[k] - before[k] for k in after if k != "compile_file_s"},
            "compile_file_s": after["compile_file_s"] - before["compile_file_s"],
            "loss": loss, "grads": grads, "ref_loss": ref_loss, "ref_grads": ref_grads,
            "stats": (stats.published, stats.loaded, stats.compiled_alone),
            "reasons": list(stats.reasons),
        }
        share_mod.encode = encode
    # Both ranks on one new directory (the ranks of one host): the first to reach the Dynamo
    # graph compiles it, backward included; the other waits, then AOTAutograd's cache
    # answers it (no tracing, no pass, no Inductor)
    shared = [tempfile.mkdtemp(prefix="share_host_", dir=root) if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = shared[0]
    from torch._dynamo.utils import counters

    aot_hits = counters["aot_autograd"]["autograd_cache_hit"]
    loss, grads, backend = _run(_two_models(0, (16, 56, 4)), x, compiled=True,
                                share_compiled="auto")
    ref_loss, ref_grads, _ = _run(_two_models(0, (16, 56, 4)), x, compiled=False)
    stats = backend.share.stats
    result["same_dir"] = {
        "whole": (stats.whole_graphs_compiled,
                  stats.whole_graphs_waited + stats.compiled_before),
        "per_graph": (stats.published, stats.loaded, stats.same_cache_dir),
        "aot_cache": backend.aot_cache,
        "aot_hits": counters["aot_autograd"]["autograd_cache_hit"] - aot_hits,
        # a Dynamo graph AOTAutogradCache answered: its forward and backward ran no pass
        "backend_aot_hits": backend.aot_cache_hits,
        "loss": loss, "grads": grads, "ref_loss": ref_loss, "ref_grads": ref_grads,
    }
    return result


def test_one_rank_compiles_for_both_and_corrupted_artifacts_are_ignored(tmp_path):
    from dist_utils import run_ranks

    rank0, rank1 = run_ranks(_shared_compile_job, 2, str(tmp_path))
    print({f"rank{r}": {case: (v["delta"], round(v["compile_file_s"], 2), v["reasons"])
                         for case, v in result.items() if "delta" in v}
           for r, result in enumerate((rank0, rank1))})
    # each graph (forward, backward) compiled once in the job: by whichever rank reached it
    # first (rank 0 or 1, each may take one), the other rank loaded it and compiled nothing
    good = (rank0["good"], rank1["good"])
    assert sum(r["delta"]["fxgraph_cache_miss"] for r in good) == 2
    assert sum(r["delta"]["fxgraph_cache_hit"] for r in good) == 2
    assert [sum(r["stats"][i] for r in good) for i in range(3)] == [2, 2, 0]
    for r in good:  # a rank's misses are exactly the graphs it published
        assert r["delta"]["fxgraph_cache_miss"] == r["stats"][0]
    # corrupted on the way: each graph's publisher (whichever rank reached it first: the
    # forward's and the backward's may differ) compiled it, the other rank found the artifacts
    # corrupted and compiled it itself; nothing was loaded
    bad = (rank0["corrupt"], rank1["corrupt"])
    assert [sum(r["stats"][i] for r in bad) for i in range(3)] == [2, 0, 2]
    assert all(r["delta"]["fxgraph_cache_miss"] == 2 for r in bad)
    reasons = [reason for r in bad for reason in r["reasons"]]
    assert len(reasons) == 2 and all("corrupted" in reason for reason in reasons)
    same = sorted((rank0["same_dir"], rank1["same_dir"]), key=lambda r: r["whole"])
    if same[0]["aot_cache"]:  # torch 2.13+: one rank compiled the whole graph, the other was
        # answered by AOTAutograd's cache and ran no pass on its forward and backward
        assert [r["whole"] for r in same] == [(0, 1), (1, 0)]  # (waited or found it marked)
        assert [(r["aot_hits"], r["backend_aot_hits"]) for r in same] == [(1, 1), (0, 0)]
    else:  # torch 2.11 (no AOTAutograd cache): they met per Inductor graph (forward, backward)
        assert [sum(r["per_graph"][i] for r in same) for i in range(3)] == [2, 2, 2]
    for r in (rank0, rank1):
        for case in r.values():  # numerics identical, shared or not, to the eager model's
            torch.testing.assert_close(case["loss"], case["ref_loss"])
            for got, want in zip(case["grads"], case["ref_grads"], strict=True):
                torch.testing.assert_close(got, want)
    for case in ("good", "corrupt", "same_dir"):  # and bit for bit across the ranks
        assert torch.equal(rank0[case]["loss"], rank1[case]["loss"])
        for a, b in zip(rank0[case]["grads"], rank1[case]["grads"], strict=True):
            assert torch.equal(a, b)


def test_a_graph_no_cache_can_answer_is_compiled_by_every_rank_at_once(fake_cache,
                                                                       monkeypatch):
    """A graph with compile regions (blocks compiled once) recompiled with a symbolic
    sequence length: torch writes its FX-graph cache entry but cannot load it back, so a
    rank that waited for another's compile would then compile it too (15.8 s against 11.2 s
    for that step on two gloo ranks). Every rank compiles it at once, without meeting; the
    static graph before it still meets."""
    with fake_process_group(2):
        torch.manual_seed(0)
        model = graphshard.shard(Llama(llama_config("tiny")))
        backend = graphshard.backend(inductor=False)
        run = torch.compile(model, backend=backend)
        for length in (16, 12):
            run(torch.randint(0, 256, (2, length))).loss.backward()
    static, dynamic = (stages["dynamo"] for stages in backend.graphs)
    assert share_mod.cache_reads_back(static) and not share_mod.cache_reads_back(dynamic)

    monkeypatch.setattr(share_mod, "cache_dir_identity", lambda: "boot:1:2:/cache")
    store = dist.HashStore()
    for transfer in (False, True):
        first, second = (CompileShare(store, r, 0.2, transfer=transfer) for r in range(2))
        first.compile_whole_graph(dynamic, [], lambda: "first")
        first.compile(dynamic, [], lambda: "first")
        assert second.compile_whole_graph(dynamic, [], lambda: "second") == "second"
        assert second.compile(dynamic, [], lambda: "second") == "second"
        for rank in (first, second):  # nobody claimed, published, waited or loaded
            stats = rank.stats
            assert stats.unshareable == 2
            assert (stats.published, stats.loaded, stats.whole_graphs_compiled,
                    stats.whole_graphs_waited, stats.compiled_alone) == (0, 0, 0, 0, 0)
    assert store.num_keys() == 0 and fake_cache == []


def test_a_warm_restart_does_not_wait_for_the_first_rank(fake_cache, monkeypatch, tmp_path):
    """A graph an earlier launch compiled into this directory: every rank of the next launch
    compiles (hits) at once, even while another rank of that launch holds the claim."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(share_mod, "cache_dir_identity", lambda: "boot:1:2:/cache")
    earlier = CompileShare(dist.HashStore(), 0, 5.0, transfer=False)
    earlier.compile_whole_graph(_Graph(), [], lambda: "cold")
    assert earlier.stats.whole_graphs_compiled == 1

    store = dist.HashStore()  # the next launch
    first, second = (CompileShare(store, r, 0.2, transfer=False) for r in range(2))
    digest = share_mod.graph_digest(_Graph(), [])
    place = share_mod.hashlib.sha256(b"boot:1:2:/cache").hexdigest()[:16]
    store.add(first._key(digest, f"whole/{place}/claim"), 1)  # rank 0 is still hitting
    assert second.compile_whole_graph(_Graph(), [], lambda: "hit") == "hit"
    assert second.stats.compiled_before == 1
    assert (second.stats.whole_graphs_waited, second.stats.compiled_alone) == (0, 0)


def test_a_failed_compile_leaves_no_marker(fake_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(share_mod, "cache_dir_identity", lambda: "boot:1:2:/cache")

    def fails():
        raise RuntimeError("inductor failed")

    with pytest.raises(RuntimeError):
        CompileShare(dist.HashStore(), 0, 5.0, transfer=False).compile_whole_graph(
            _Graph(), [], fails)
    again = CompileShare(dist.HashStore(), 0, 5.0, transfer=False)
    again.compile_whole_graph(_Graph(), [], lambda: None)
    assert (again.stats.compiled_before, again.stats.whole_graphs_compiled) == (0, 1)


def test_a_rank_whose_first_rank_never_finishes_compiles_itself(fake_cache, monkeypatch,
                                                                 tmp_path):
    """The first rank of the directory claimed the graph and never finished (it died, or
    hangs): after the timeout the waiting rank compiles for itself, and says what it waited
    for."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(share_mod, "cache_dir_identity", lambda: "boot:1:2:/cache")
    store = dist.HashStore()
    first, second = (CompileShare(store, r, 0.2, transfer=False) for r in range(2))
    digest = share_mod.graph_digest(_Graph(), [])
    place = share_mod.hashlib.sha256(b"boot:1:2:/cache").hexdigest()[:16]
    store.add(first._key(digest, f"whole/{place}/claim"), 1)  # claimed, never done
    assert second.compile_whole_graph(_Graph(), [], lambda: "own") == "own"
    assert (second.stats.whole_graphs_waited, second.stats.compiled_alone) == (0, 1)
    assert second.stats.reasons == [
        "waited 0.2 s for the first rank of this cache directory to finish compiling"]
