"""One Inductor compilation for N ranks: the first rank to reach a graph compiles it and
publishes the artifacts through the process group's store; ranks with the same graph load
them instead of compiling.

Why: in SPMD training every rank traces and compiles the same graphs; without sharing, N
processes pay N identical Inductor compilations (and on one host compete for the same CPU
cores while doing so). With it, one rank compiles each distinct graph and the others load
the result (``torch.compiler.save_cache_artifacts`` / ``load_cache_artifacts``), which fills
their Inductor FX-graph cache so that their own ``compile_fx_inner`` hits.

Protocol, per graph handed to Inductor (the forward and backward of every Dynamo graph):

1. Every rank computes :func:`graph_digest` of the graph the passes produced (its code,
   its inputs' metadata and the compile flags). Ranks whose graphs differ get different
   digests and never wait for each other: each compiles its own.
2. ``store.add(claim, 1)`` elects the first rank to reach a digest as its publisher. The
   publisher compiles, serialises the artifacts and writes them in two steps: the payload
   under a data key, then the payload's SHA-256 under a ``ready`` key (the commit, like a
   rename after writing a temporary file). A publisher whose compile fails writes a
   ``failed`` key. A publisher never waits for anybody before publishing, so ranks cannot
   deadlock on each other's claims.
3. The other ranks wait for ``ready`` or ``failed`` (at most ``timeout_s``), read the
   payload, check its length and checksum and load it. A missing commit (the publisher died
   mid-write), a failure, a timeout, a checksum mismatch or a load error are all the same to
   them: they compile the graph themselves. Correctness never rests on the digest: what is
   loaded only populates Inductor's cache under Inductor's own keys, so a graph that differs
   in anything the digest missed simply misses that cache and compiles.

Ranks that share one Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``: the ranks of one
host by default) load nothing: the publisher's compile already wrote its entries into that
very directory, so the waiting rank only waits for the commit and then compiles, which hits
Inductor's cache there. The publisher publishes, next to the payload, the identity of its
cache directory (the kernel's boot id, the directory's device and inode); a rank whose own
directory has the same identity skips ``load_cache_artifacts``. Loading there would only
rewrite (atomically, but needlessly) every entry of the payload into the directory the
ranks are compiling and loading kernels from at the same time. A payload holds the artifacts
of its own graph only (:func:`compile_saving_its_artifacts`): ``save_cache_artifacts`` alone
is cumulative, and would send every earlier graph again with each new one.

What is shared is Inductor's FX-graph cache entries (with GPU Triton kernels bundled into
them, Inductor's ``bundle_triton_into_fx_graph_cache``). On the CPU the C++ kernels are not in
those entries: a rank with a cache directory of its own skips Inductor's lowering and code
generation but still runs the C++ compiler on the loaded code (measured: 0 FX-graph misses,
C++ compiles as before). Ranks of one host normally share one cache directory
(``TORCHINDUCTOR_CACHE_DIR``, by default per user under ``/tmp``) and find those there too.

All of the above is ``share_compiled=True``. The default, ``"auto"``
(``transfer=False`` here), keeps ranks within one cache directory: claims are scoped by the
directory's identity, the first rank of a directory compiles while the others of that
directory wait and then hit its entries there, and no artifact is serialised or sent.
With AOTAutograd's cache on (``backend(aot_cache=...)``, the default on torch 2.13 and
newer), the ranks of one directory meet first on the whole Dynamo graph
(:meth:`CompileShare.compile_whole_graph`, keyed by its code, its inputs, their local shards
and the plan), with the backward compiled along with the forward: the first rank's
AOTAutogradCache entry then exists when it is done, and the ranks that waited for it are
answered by that entry, skipping AOTAutograd's tracing, the partitioner and graphshard's
passes as well as Inductor. Once the first rank is done it leaves a marker file in the
directory (``graphshard_compiled/``); on a warm restart, ranks that find the marker for
their graph skip the meeting and hit the cache all at once instead of in turn.

Enabled by the backend option ``share_compiled`` (default ``"auto"``: on, within cache
directories, when the default process group has more than one rank on a real backend, gloo
or NCCL; a fake process group has no shared store; ``True`` adds the transfer across
directories).
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from graphshard.passes.regions import region_calls

__all__ = ["CompileShare", "ShareStats", "cache_dir_identity", "cache_reads_back",
           "compile_saving_its_artifacts",
           "graph_digest", "share_from_default_group", "encode", "decode"]

log = logging.getLogger(__name__)

_MAGIC = b"GSCA1"  # graphshard compile artifacts, format 1
_HEADER = struct.Struct(">5sQ32s")  # magic, payload length, SHA-256 of the payload
_REAL_BACKENDS = ("gloo", "nccl", "xccl", "ucc", "mpi")


def encode(payload: bytes) -> bytes:
    """``payload`` framed with a magic number, its length and its SHA-256."""
    return _HEADER.pack(_MAGIC, len(payload), hashlib.sha256(payload).digest()) + payload


def decode(blob: bytes) -> bytes | None:
    """The payload of an :func:`encode` frame; None for anything truncated or corrupted."""
    if len(blob) < _HEADER.size:
        return None
    magic, length, digest = _HEADER.unpack_from(blob)
    payload = blob[_HEADER.size:]
    if magic != _MAGIC or len(payload) != length or hashlib.sha256(payload).digest() != digest:
        return None
    return payload


def graph_digest(gm: fx.GraphModule, example_inputs: Sequence[Any], **flags: Any) -> str:
    """A digest of what Inductor is asked to compile: the graph's code, every input's
    type, shape, stride, dtype and device, the compile flags (``is_backward``...) and the
    torch version. Equal digests on two ranks mean the same compile request."""
    h = hashlib.sha256(torch.__version__.encode())
    h.update(gm.code.encode())
    for value in example_inputs:
        if isinstance(value, torch.Tensor):
            h.update(repr((type(value).__name__, tuple(value.shape), tuple(value.stride()),
                           value.dtype, value.device.type)).encode())
        else:
            h.update(repr(type(value).__name__).encode())
    h.update(repr(sorted(flags.items())).encode())
    return h.hexdigest()[:32]


def cache_reads_back(gm: fx.GraphModule) -> bool:
    """Whether Inductor's caches can answer a rank that waits for ``gm``'s compilation. Not
    for a graph that calls compile regions (``invoke_subgraph``: the blocks compiled once)
    and has symbolic sizes (a recompile for a second sequence length): torch 2.11 to 2.14.1
    write its FX-graph cache entry but cannot load it back (the pickled region body re-traces
    an op whose size list holds a proxy; docs/torch-versions.md), so a rank that waited
    would compile it all the same, after the first. There every rank compiles at once."""
    if next(region_calls(gm), None) is None:
        return True
    return not any(free_symbols(node.meta.get("example_value", node.meta.get("val")))
                   for node in gm.graph.find_nodes(op="placeholder"))


def cache_dir_identity() -> str | None:
    """Who this process's Inductor cache directory is, the same string in every process that
    uses the same directory on the same machine: the kernel's boot id (else the host name),
    the directory's device and inode. None when it cannot be told (the directory does not
    exist yet): then nothing is assumed shared."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    try:
        path = os.path.realpath(cache_dir())
        st = os.stat(path)
    except OSError:
        return None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = f.read().strip()
    except OSError:
        import socket

        machine = socket.gethostname()
    return f"{machine}:{st.st_dev}:{st.st_ino}:{path}"


def _marker_path(level: str, digest: str) -> str:
    """Where the cache directory records that ``digest`` was compiled into it (a file)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "graphshard_compiled", f"{level}-{digest}")


def _mark_compiled(marker: str) -> None:
    """Record, after its entries are written, that the graph ``marker`` names is compiled
    into this cache directory. A marker that cannot be written only costs a wait later."""
    try:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        with open(marker, "a"):
            pass
    except OSError as exc:
        log.info("graphshard could not mark %s compiled: %r", marker, exc)


@dataclass
class ShareStats:
    """What this process did with the graphs it compiled (:attr:`CompileShare.stats`)."""

    published: int = 0  # graphs this rank compiled and published
    loaded: int = 0  # graphs whose artifacts this rank loaded from another rank
    compiled_alone: int = 0  # graphs this rank compiled because nothing usable came
    same_cache_dir: int = 0  # of ``loaded``: found in the cache directory shared with the publisher
    whole_graphs_compiled: int = 0  # Dynamo graphs this rank compiled first for its directory
    whole_graphs_waited: int = 0  # Dynamo graphs it waited for (then AOTAutogradCache hits)
    compiled_before: int = 0  # graphs marked compiled in this directory by an earlier launch
    unshareable: int = 0  # graphs every rank compiled at once: no cache entry could answer
    reasons: list[str] = field(default_factory=list)  # why, for each compiled_alone


class CompileShare:
    """Compile-once-per-job through a ``torch.distributed`` store (see the module docstring).

    Args:
        store: a store every rank reaches (the default process group's).
        rank: this process's rank (for logs only).
        timeout_s: how long a rank waits for another rank's artifacts before compiling
            itself.
        namespace: a prefix for the store keys (one per job run: the store is fresh per
            launch with ``torchrun``; pass something unique to share a store between runs).
    """

    def __init__(self, store: dist.Store, rank: int, timeout_s: float = 900.0,
                 namespace: str = "graphshard/compile", transfer: bool = True) -> None:
        self.store = store
        self.rank = rank
        self.timeout_s = timeout_s
        self.namespace = namespace
        self.transfer = transfer
        self.stats = ShareStats()

    def _key(self, digest: str, what: str) -> str:
        return f"{self.namespace}/{digest}/{what}"

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                compile_fn: Callable[[], Any], **flags: Any) -> Any:
        """``compile_fn()`` (Inductor on ``gm``), compiled once among the ranks that ask for
        the same graph; the others load what the first published, then call it (a hit)."""
        if not cache_reads_back(gm):
            return self._unshared(compile_fn)
        digest = graph_digest(gm, example_inputs, **flags)
        if not self.transfer:  # only ranks of one cache directory meet; nothing travels
            return self._first_in_directory(digest, "graph", compile_fn, first=("published",),
                                            waited=("loaded", "same_cache_dir"))
        if self.store.add(self._key(digest, "claim"), 1) == 1:
            return self._publish(digest, compile_fn)
        self._after_waiting(digest, self._load(digest), ("loaded",))
        return compile_fn()

    def compile_whole_graph(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                            compile_fn: Callable[[], Any], **flags: Any) -> Any:
        """``compile_fn()`` for a whole Dynamo graph (AOTAutograd, the passes, Inductor),
        run first by one rank of each cache directory; the others of that directory wait
        until it is done, then run it too and are answered by AOTAutograd's cache. Ranks of
        another directory do not wait (they meet per Inductor graph in :meth:`compile`).
        ``compile_fn`` must leave a complete AOTAutogradCache entry (backward included)."""
        if not cache_reads_back(gm):
            return self._unshared(compile_fn)
        return self._first_in_directory(graph_digest(gm, example_inputs, **flags), "whole",
                                        compile_fn, first=("whole_graphs_compiled",),
                                        waited=("whole_graphs_waited",))

    def _unshared(self, compile_fn: Callable[[], Any]) -> Any:
        """``compile_fn()`` on this rank without meeting the others (see
        :func:`cache_reads_back`)."""
        self._count(("unshareable",))
        return compile_fn()

    def _first_in_directory(self, digest: str, level: str, compile_fn: Callable[[], Any], *,
                            first: tuple[str, ...], waited: tuple[str, ...]) -> Any:
        """``compile_fn()``, run first by one rank of this cache directory while the others
        of the directory wait for it to finish and then run it (a hit there). The stats
        named in ``first`` or ``waited`` count this rank's part. Where the directory cannot
        be told, every rank compiles at once. So does every rank for a graph that an earlier
        launch compiled into this directory (the first rank leaves a marker file there once
        its entries are written): all of them hit the cache, and waiting for one another
        would only make the hits take turns."""
        here = cache_dir_identity()
        if here is None:
            return compile_fn()
        marker = _marker_path(level, digest)
        if os.path.exists(marker):  # a warm restart: every rank hits at once, none waits
            self._count(("compiled_before",))
            return compile_fn()
        place = hashlib.sha256(here.encode()).hexdigest()[:16]
        claim = self._key(digest, f"{level}/{place}/claim")
        done = self._key(digest, f"{level}/{place}/done")
        if self.store.add(claim, 1) == 1:
            try:
                compiled = compile_fn()
                _mark_compiled(marker)
            finally:  # a failure, too, releases the others (each then compiles for itself)
                self.store.set(done, b"1")
            self._count(first)
            return compiled
        self._after_waiting(digest, self._wait([done], "the first rank of this cache directory "
                                               "to finish compiling"), waited)
        return compile_fn()

    def _after_waiting(self, digest: str, reason: str | None, waited: tuple[str, ...]) -> None:
        """Count a wait that ended well (``reason`` None) in the stats named ``waited``; else
        count, keep and log why this rank compiles the graph itself."""
        if reason is None:
            self._count(waited)
            return
        self.stats.compiled_alone += 1
        self.stats.reasons.append(reason)
        log.warning("graphshard rank %d compiles graph %s itself: %s", self.rank, digest, reason)

    def _count(self, names: tuple[str, ...]) -> None:
        for name in names:
            setattr(self.stats, name, getattr(self.stats, name) + 1)

    def _wait(self, keys: list[str], what: str) -> str | None:
        """Wait until one of ``keys`` is in the store: None, or why the wait ended without
        (``what``: what the wait was for, named in that reason)."""
        deadline = time.monotonic() + self.timeout_s
        delay = 0.01
        while not any(self.store.check([key]) for key in keys):
            if time.monotonic() >= deadline:
                return f"waited {self.timeout_s:g} s for {what}"
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        return None

    def _publish(self, digest: str, compile_fn: Callable[[], Any]) -> Any:
        try:
            compiled, saved = compile_saving_its_artifacts(compile_fn)
        except BaseException:
            self.store.set(self._key(digest, "failed"), b"1")
            raise
        if saved is None:
            self.store.set(self._key(digest, "failed"), b"nothing to publish")
            return compiled
        blob = encode(saved[0])
        # where the compile wrote its entries: a rank with the same directory loads nothing
        self.store.set(self._key(digest, "origin"), cache_dir_identity() or "")
        self.store.set(self._key(digest, "data"), blob)  # the temporary file ...
        self.store.set(self._key(digest, "ready"), hashlib.sha256(blob).hexdigest())  # renamed
        self.stats.published += 1
        return compiled

    def _load(self, digest: str) -> str | None:
        """Load the artifacts published for ``digest``; None on success, else why not."""
        ready, failed = self._key(digest, "ready"), self._key(digest, "failed")
        timed_out = self._wait([ready, failed], "another rank's published artifacts")
        if timed_out is not None:
            return timed_out
        if self.store.check([failed]):
            return "its publisher failed"
        origin = self._key(digest, "origin")
        here = cache_dir_identity()
        if here is not None and self.store.check([origin]) \
                and self.store.get(origin).decode() == here:
            # the publisher compiled into this very cache directory: its entries are here
            # already, and the compile that follows hits them
            self.stats.same_cache_dir += 1
            return None
        committed = self.store.get(ready).decode()
        blob = self.store.get(self._key(digest, "data")) \
            if self.store.check([self._key(digest, "data")]) else b""
        if hashlib.sha256(blob).hexdigest() != committed:
            return "the published artifacts do not match their commit (partial write)"
        payload = decode(blob)
        if payload is None:
            return "the published artifacts are corrupted (checksum mismatch)"
        try:
            torch.compiler.load_cache_artifacts(payload)
        except Exception as exc:  # a payload from another torch build, a full disk
            return f"loading the artifacts failed: {exc!r}"
        return None


def compile_saving_its_artifacts(compile_fn: Callable[[], Any]) -> tuple[Any, Any]:
    """``compile_fn()`` and ``torch.compiler.save_cache_artifacts()`` of what that compile
    alone recorded.

    Why: ``save_cache_artifacts`` is cumulative, its bytes hold every artifact the process
    recorded since it started, one segment per earlier call. Publishing each graph with it
    sent every earlier graph again (O(G^2) bytes through the store for a job of G graphs).
    It also spent the process's record: torch's loader keeps only the last segment of each
    kind, so a user's own ``save_cache_artifacts`` at the end of the job (a "mega-cache" for
    the next launch) loaded back only the last graph graphshard had published. Here the
    compile records into a fresh list (torch's ``CacheArtifactManager.with_fresh_cache``),
    which alone is serialised; its artifacts then join the process's own record, not yet
    serialised there (every supported torch, 2.11 on, has the switch)."""
    from torch.compiler._cache import CacheArtifactManager as manager

    with manager.with_fresh_cache():
        compiled = compile_fn()
        recorded = [(kind, list(artifacts))
                    for kind, artifacts in manager._new_cache_artifacts.items()]
        saved = torch.compiler.save_cache_artifacts()
    for kind, artifacts in recorded:  # the process's own list keeps them too
        for artifact in artifacts:
            if artifact not in manager._seen_artifacts:
                manager._new_cache_artifacts[kind].append(artifact)
                manager._seen_artifacts.add(artifact)
    return compiled, saved


def share_from_default_group(timeout_s: float, transfer: bool = True) -> CompileShare | None:
    """A :class:`CompileShare` on the default process group's store, or None where sharing
    cannot help: no process group, one rank, or a backend without a shared store (the fake
    process groups). ``transfer``: artifacts also travel to ranks of other cache directories
    (``share_compiled=True``); else only ranks of one directory meet."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    backend = str(dist.get_backend()).lower()
    if not any(name in backend for name in _REAL_BACKENDS):
        return None
    import os

    from torch.distributed.distributed_c10d import _get_default_store

    # torchrun may keep its store across restarts of the workers: a restart gets keys of its
    # own, never the claim of a worker that died before publishing
    launch = "/".join(os.environ.get(name, "-") for name in
                      ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"))
    return CompileShare(_get_default_store(), dist.get_rank(), timeout_s,
                        namespace=f"graphshard/compile/{launch}", transfer=transfer)
