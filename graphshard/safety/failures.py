"""When one rank fails, make every other rank fail too, quickly and with a clear error.

Collectives block until every rank joins. A rank that raises, dies or hangs leaves the
others waiting inside a collective until the process-group timeout
(``init_process_group(timeout=...)``), and then they fail with a transport error such as
gloo's ``Connection reset by peer`` or ``Timed out waiting 3000ms for recv``, which does
not say which rank failed or why. Wrap the training loop in :func:`report_rank_failures`:

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    with graphshard.report_rank_failures():
        for step in ...:
            ...

- A rank that raises publishes its error in the process group's store before its process
  exits (which makes its peers' pending collectives fail at once).
- A rank whose collective fails raises :class:`RankFailureError`, naming the rank that
  failed first and its error, or saying that no rank reported one (a rank died or hung) and
  what the timeout was.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from graphshard.errors import RankFailureError

__all__ = ["RankFailureError", "report_rank_failures", "process_group_timeout"]

_KEY = "graphshard/failed/"
_TRANSPORT_WORDS = (
    "connection closed", "connection reset", "timed out", "timeout", "broken pipe",
    "peer", "nccl", "gloo", "watchdog", "aborted",
)


def process_group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout the collectives of ``group`` wait for before failing, when known."""
    try:
        pg = group or dist.group.WORLD
        for device in ("cpu", "cuda"):
            try:
                backend = pg._get_backend(torch.device(device))
            except Exception:  # no backend for this device type: try the next one
                continue
            timeout = getattr(getattr(backend, "options", None), "_timeout", None)
            if timeout is not None:
                return timeout
    except Exception:  # private API, best effort: only the advice in a message needs it
        return None
    return None


def _store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # reporting is best effort: no store means no cross-rank report
        return None


def _is_collective_failure(exc: BaseException) -> bool:
    if isinstance(exc, dist.DistError):
        return True
    if type(exc) is RuntimeError:
        text = str(exc).lower()
        return any(word in text for word in _TRANSPORT_WORDS)
    return False


def _publish(rank: int, exc: BaseException) -> None:
    store = _store()
    if store is None:
        return
    frame = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {frame[0].filename}:{frame[0].lineno}" if frame else ""
    try:
        store.set(f"{_KEY}{rank}", f"{type(exc).__name__}: {exc}{where}"[:2000])
    except Exception:  # the store may be down too: the caller re-raises the real error anyway
        pass


def _reports(world_size: int, wait_s: float) -> dict[int, str]:
    """Errors other ranks published; waits up to ``wait_s`` for a first one to land."""
    store = _store()
    if store is None:
        return {}
    deadline = time.monotonic() + wait_s
    while True:
        found = {}
        try:
            for r in range(world_size):
                key = f"{_KEY}{r}"
                if store.check([key]):
                    found[r] = store.get(key).decode(errors="replace")
        except Exception:  # the store went away: report what was read; the caller raises
            return found
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


@contextmanager
def report_rank_failures(report_wait_s: float = 1.0) -> Iterator[None]:
    """Turn a failure on any rank into a clear error on every rank.

    On this rank's own exception: publish it for the other ranks, then re-raise it. On a
    failed collective (another rank raised, died or hung past the process-group timeout):
    raise :class:`RankFailureError` naming the rank that failed and its error.

    Args:
        report_wait_s: how long a rank whose collective failed waits for the failing rank's
            report to arrive in the store (only on the failure path).
    """
    if not (dist.is_available() and dist.is_initialized()):
        yield
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    try:
        yield
    except BaseException as exc:
        if not _is_collective_failure(exc):
            _publish(rank, exc)
            raise
        reports = {r: m for r, m in _reports(world_size, report_wait_s).items() if r != rank}
        timeout = process_group_timeout()
        limit = f" (process-group timeout {timeout.total_seconds():g} s)" if timeout else ""
        first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        if reports:
            who = "; ".join(f"rank {r} failed: {m}" for r, m in sorted(reports.items()))
            message = (
                f"Rank {rank} stopped: another rank failed while this one waited in a "
                f"collective. {who}. See that rank's log for the traceback. "
                f"(This rank's collective error: {first_line})"
            )
        else:
            message = (
                f"Rank {rank} stopped: a collective failed{limit} and no rank reported an "
                "error, so a rank died (killed, out of memory) or hung, or took a different "
                "code path. Check the other ranks' logs. If a rank is legitimately slow (a "
                "long first compile, a slow checkpoint), raise the timeout with "
                f"init_process_group(timeout=...). (Collective error: {first_line})"
            )
        raise RankFailureError(message) from exc
