"""Run a function on N real gloo ranks (separate processes) and collect what each returns.

Every launch of the suite starts its ranks from one fork server per test process
(:func:`rank_context`), which has imported torch and graphshard once: a rank starts in a
fraction of a second instead of importing them again (about 3 s of CPU a rank, on every
launch). What a rank must not inherit from the server, the environment, it gets from the
launching test as it is at the launch (:func:`in_launch_env`)."""

from __future__ import annotations

import faulthandler
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once by the fork server; every rank forks from it with these loaded (and with
# what ``rank_warmup`` computes on import).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo",
           "torch._inductor.compile_fx", "graphshard", "rank_warmup"]
START_METHOD = "forkserver"
# The all-gathers an op counter sees, by op, with the index of the tensor each sends: the
# functional one, and gloo's single-tensor one that graphshard's eager gathers issue there
# (graphshard.safety.gloo_gather).
ALL_GATHER_SENT = {torch.ops._c10d_functional.all_gather_into_tensor.default: 0,
                   torch.ops.c10d._allgather_base_.default: 1}
_COLLECTION_ENV = dict(os.environ)


def rank_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context of every rank launch: a fork server that preloads
    :data:`PRELOAD` (set before the server's first start; a started server keeps its
    modules). Its children share nothing else with this process: no threads, no Dynamo
    state, no compiled graphs."""
    context = multiprocessing.get_context(START_METHOD)
    context.set_forkserver_preload(PRELOAD)
    # Start the server (once) in the environment of collection time: what torch reads from
    # the environment at import must not depend on which test happened to launch first.
    # The server finds ``rank_warmup`` beside this file through PYTHONPATH: Python 3.11's
    # fork server is handed the launcher's sys.path but does not apply it before its
    # preloads, and skips a preload it cannot import without a word.
    launching = dict(os.environ)
    os.environ.clear()
    os.environ.update(_COLLECTION_ENV)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parent), _COLLECTION_ENV.get("PYTHONPATH")) if p)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(launching)
    return context


def in_launch_env(rank: int, env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(rank, *args)`` with the launching process's environment ``env``: a forked
    rank would otherwise see the fork server's, as it was when the server started. A rank
    killed by a signal (SIGSEGV, SIGABRT from glibc's heap checks) prints every thread's
    Python stack to the test's captured stderr first; so does a rank the launcher terminates
    (SIGTERM) because another failed: where a hung rank was stuck."""
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    os.environ.clear()
    os.environ.update(env)
    return fn(rank, *args)


def _logged_rank(rank: int, env: dict[str, str], log_dir: str, fn: Callable[..., Any],
                 *args: Any) -> Any:
    """:func:`in_launch_env` with the rank's stderr (native writers included: glibc, C++
    ``std::terminate``, faulthandler) going to ``log_dir/rank{rank}.stderr``."""
    log = open(Path(log_dir) / f"rank{rank}.stderr", "w")  # noqa: SIM115 (lives as the rank)
    os.dup2(log.fileno(), 2)
    try:
        return in_launch_env(rank, env, fn, *args)
    except BaseException:
        traceback.print_exc()  # for the launcher's report if another rank dies by a signal
        raise


class RankCrashed(RuntimeError):
    """A rank was killed by a signal: no Python traceback exists, so the message carries
    the end of what the rank wrote to stderr (the C-level reason and its Python stacks)."""


def crash_summary(stderr_text: str) -> str:
    """One line out of a failed rank's stderr: the native message printed just before
    faulthandler's ``Fatal Python error`` (glibc's heap check, ``terminate called ...``,
    ``what(): ...``) and the innermost Python frame of the thread that crashed; for a rank
    that raised, its exception's line."""
    lines = [line.rstrip() for line in stderr_text.splitlines() if line.strip()]
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")),
                 None)
    if fatal is None:  # a Python traceback (the exception's line follows its frames) or not
        start = max((i for i, line in enumerate(lines) if line.startswith("Traceback")),
                    default=None)
        raised = [] if start is None else [line for line in lines[start + 1:]
                                           if not line.startswith(" ")]
        return raised[0] if raised else lines[-1] if lines else "(nothing on stderr)"
    native = [line for line in lines[max(0, fatal - 2):fatal] if not line.startswith("[rank")]
    current = next((i for i in range(fatal, len(lines))
                    if lines[i].startswith("Current thread")), None)
    frame = [lines[current + 1].strip()] if current is not None and current + 1 < len(lines) else []
    return " | ".join([*native, lines[fatal], *frame])


def start_ranks(fn: Callable[..., Any], nprocs: int, *args: Any) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs)`` from :func:`rank_context`,
    in this process's current environment; raises with a failed rank's traceback, or, for a
    rank killed by a signal, :class:`RankCrashed` with the end of its stderr. What the ranks
    wrote to stderr is copied to this process's stderr (the test's captured output)."""
    rank_context()
    crashed: mp.ProcessExitedException | None = None
    with tempfile.TemporaryDirectory() as log_dir:
        try:
            mp.start_processes(_logged_rank, args=(dict(os.environ), log_dir, fn, *args),
                               nprocs=nprocs, join=True, start_method=START_METHOD)
        except mp.ProcessExitedException as exc:
            crashed = exc
        finally:  # also when a rank raised (torch's error carries its traceback)
            texts = [_read(Path(log_dir) / f"rank{rank}.stderr") for rank in range(nprocs)]
            sys.stderr.write("".join(texts))
    if crashed is not None:
        raise _crash_error(crashed, texts) from crashed


def _crash_error(exc: mp.ProcessExitedException, texts: list[str]) -> RankCrashed:
    """The error for a rank killed by a signal, from every rank's stderr (``texts``): a rank
    that raised or crashed beside it may be the cause, though torch's launcher reports
    whichever failed rank it saw first."""
    dead = exc.error_index
    others = [f"rank {rank}: {crash_summary(text)}" for rank, text in enumerate(texts)
              if rank != dead and ("Traceback" in text or "Fatal Python error" in text)]
    tail = "\n".join(texts[dead].splitlines()[-60:])
    return RankCrashed(
        f"rank {dead} of {len(texts)} died with "
        f"{exc.signal_name or f'exit code {exc.exit_code}'}: {crash_summary(texts[dead])}"
        + "".join(f"; also failed: {line}" for line in others)
        + f"\n--- the end of its stderr ---\n{tail}")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _rank_main(rank: int, world_size: int, store_path: str, out_dir: str, fn, args) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    # No rank may finish (and close its connections) while another is still connecting its
    # gloo mesh: a job without collectives, whose ranks start at different times, otherwise
    # fails there with "connectFullMesh failed ... Connection closed by peer".
    dist.barrier()
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function (it is pickled into spawned processes). A failure
    on any rank raises here with that rank's traceback.
    """
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        start_ranks(_rank_main, world_size, world_size, store_path, tmp, fn, args)
        paths = [Path(tmp) / f"rank{r}.pt" for r in range(world_size)]
        return [torch.load(path, weights_only=False) for path in paths]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A snapshot of the model's full (unsharded) state dict through torch's own API.

    Cloned: for a replicated (0-D) parameter torch returns the live local tensor, which the
    optimizer then updates in place.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in full.items()}


def assert_eager_grads(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Every parameter's gradient of the sharded ``model``, gathered whole, matches the
    unsharded ``reference``'s (rtol 1e-4, atol 1e-6), named in the message where not; a
    parameter the reference's step left without a gradient has none either."""
    for (name, want), got in zip(reference.named_parameters(), model.parameters(), strict=True):
        if want.grad is None:
            assert got.grad is None, f"{name}: a gradient where the reference has none"
            continue
        torch.testing.assert_close(got.grad.full_tensor(), want.grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")


def compiled_backward(build: Callable[[], torch.nn.Module], x: torch.Tensor
                      ) -> tuple[torch.nn.Module, torch.nn.Module, Any, list]:
    """One backward of ``build()`` on ``x``, eagerly, and of a sharded copy compiled by
    graphshard with Inductor off: (reference, sharded model, its backend, the warnings raised
    while it compiled and ran)."""
    import copy
    import warnings

    import graphshard

    reference = build()
    model = graphshard.shard(copy.deepcopy(reference))
    reference(x).backward()
    backend = graphshard.backend(inductor=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend=backend)(x).backward()
    return reference, model, backend, caught


def assert_compiled_gets_eager_grads(build: Callable[[], torch.nn.Module],
                                     backward: Callable[[Callable[..., Any]], None]) -> None:
    """A model from ``build()``, sharded (at the current group's size) and compiled by
    graphshard, gets from ``backward(run)`` the gradients that the unsharded model from
    another ``build()`` gets eagerly (:func:`assert_eager_grads`)."""
    import graphshard

    reference = build()
    backward(reference)
    model = graphshard.shard(build())
    backward(torch.compile(model, backend=graphshard.backend()))
    assert_eager_grads(model, reference)


def example_runner(monkeypatch, *common: str) -> Callable[..., float]:
    """``examples/train_llama.py``'s ``main`` as a function of its arguments, run as a
    world-1 job in this process (a free port per call); ``common`` prefixes every call."""
    import importlib.util
    import socket

    spec = importlib.util.spec_from_file_location(
        "train_llama_example", Path(__file__).parents[1] / "examples" / "train_llama.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)

    def main(*argv: str) -> float:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            monkeypatch.setenv("MASTER_PORT", str(s.getsockname()[1]))
        return example.main([*common, *argv])

    return main


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_port(out_dir: str, run: int, rank: int, timeout_s: float = 600.0) -> int:
    """The rendezvous port of run ``run`` of a launch, agreed by its ranks through a file.

    Rank 0 picks a free port just before the run's process group starts and publishes it;
    the other ranks wait for it. Ports picked for every run up front could be taken, by the
    time a later run binds them, by an ephemeral port of an earlier run's gloo connections
    (EADDRINUSE on CI).
    """
    import time

    path = Path(out_dir) / f"port{run}"
    if rank == 0:
        staged = path.with_suffix(".staged")
        staged.write_text(str(_free_port()))
        staged.rename(path)  # atomic: a reader sees the whole number or no file
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: rank 0 published no port for run {run} "
                               f"in {timeout_s:.0f} s")
        time.sleep(0.05)
    return int(path.read_text())


def _example_rank(rank: int, launched: int, runs: list[tuple[int, list[str]]],
                  out_dir: str) -> None:
    import importlib.util

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location(
        "train_llama_example", Path(__file__).parents[1] / "examples" / "train_llama.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    losses: list[float | None] = []
    for index, (world_size, argv) in enumerate(runs):
        if rank >= world_size:  # a smaller run: this rank sits it out
            losses.append(None)
            continue
        port = run_port(out_dir, index, rank)
        os.environ.update(WORLD_SIZE=str(world_size), MASTER_PORT=str(port))
        torch._dynamo.reset()  # each run compiles its own model
        losses.append(example.main(argv))
    torch.save(losses, Path(out_dir) / f"rank{rank}.pt")


def example_ranks(*runs: tuple[int, list[str]]) -> list[list[float | None]]:
    """Run ``examples/train_llama.py``'s ``main`` once per ``(world_size, argv)`` in ``runs``,
    in order, each on ranks ``0 .. world_size - 1`` of one launch of spawned processes (as
    many as the largest run needs; the others sit a smaller run out) with its own gloo
    process group. Returns, per rank, the final loss each run's ``main`` returned (None
    where the rank sat out)."""
    launched = max(world for world, _ in runs)
    with tempfile.TemporaryDirectory() as tmp:
        start_ranks(_example_rank, launched, launched,
                    [(world, list(argv)) for world, argv in runs], tmp)
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(launched)]
