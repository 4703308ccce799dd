"""What keeps graphshard's checkpoints honest across ranks and on disk.

- :func:`agree`: one ``all_gather_object`` per stage of a save or load, so an error on any
  rank (or a disagreement between ranks) is raised on every rank at once, never left to a
  collective timeout.
- :func:`check_arrival`: a short ``monitored_barrier`` (gloo) so a rank that calls a
  collective checkpoint function alone fails fast, saying so.
- The commit marker: its JSON holds a commit counter (``seq``: the order "latest" and
  pruning follow) and the CRC-32 and size of every file of the checkpoint, verified at load.
- ``graphshard.pt`` is read with ``torch.load(weights_only=True)``; :func:`serialize_meta`
  refuses, at save, anything such a load would refuse.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import zlib
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from graphshard.errors import GraphshardRuntimeError, GraphshardValueError

COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_OLD_DIR = re.compile(r"^\.old-step_(\d+)$")
_CHUNK = 8 << 20


# --------------------------------------------------------------------------- ranks agreeing


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def agree(
    error: BaseException | None, group: dist.ProcessGroup | None, stage: str,
    payload: Any = None,
) -> list[Any]:
    """Every rank's ``payload``, once every rank reached this point; raises on every rank
    when any rank had an ``error`` (a rank raises its own; the others name the rank and its
    error). A collective: one ``all_gather_object``."""
    rank, world = _world(group)
    if world == 1:
        if error is not None:
            raise error
        return [payload]
    said = None if error is None else f"{type(error).__name__}: {error}"
    entries: list[Any] = [None] * world
    dist.all_gather_object(entries, (said, payload), group=group)
    if error is not None:
        raise error
    failed = [(r, e) for r, (e, _) in enumerate(entries) if e is not None]
    if failed:
        r, e = failed[0]
        others = f" (and on rank(s) {[f for f, _ in failed[1:]]})" if len(failed) > 1 else ""
        raise GraphshardRuntimeError(f"{stage} failed on rank {r}{others}: {e}")
    return [p for _, p in entries]


def check_arrival(group: dist.ProcessGroup | None, timeout_s: float | None, what: str) -> None:
    """Fail within ``timeout_s`` (not the process-group timeout) when a rank does not call
    the collective ``what``. Gloo only (``monitored_barrier``); a no-op for other backends,
    a world of one, or ``timeout_s=None``."""
    rank, world = _world(group)
    if timeout_s is None or world == 1 or dist.get_backend(group) != "gloo":
        return
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s),
                               wait_all_ranks=True)
    except RuntimeError as exc:
        raise GraphshardRuntimeError(
            f"{what} is a collective: every rank of the process group must call it, and "
            f"not every rank did within {timeout_s:g} s (rank {rank} waited). Call it on all "
            "ranks (the process group is not usable after this error). "
            f"gloo said: {str(exc).splitlines()[0]}"
        ) from exc


# --------------------------------------------------------------------------- checksums


def file_crc32(path: Path) -> tuple[int, int]:
    """CRC-32 (zlib) and size of the file at ``path``, read in 8 MiB chunks."""
    crc, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return crc, size


class RecordingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that remembers the files this rank wrote (``written``),
    so the rank can checksum them; the files themselves are DCP's, unchanged."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.written: set[str] = set()

    def write_data(self, plan, planner):  # noqa: ANN001, ANN201  (DCP's signature)
        results = super().write_data(plan, planner).wait()
        self.written.update(r.storage_data.relative_path for r in results)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(results)
        return done


def verify_files(path: Path, files: dict[str, list[int]], rank: int, world: int) -> None:
    """Check this rank's share (every ``world``-th, sorted by name) of ``files``
    (``name -> [crc32, size]``) under ``path``; raise naming the first bad file."""
    for i, name in enumerate(sorted(files)):
        if i % world == rank:
            verify_file(path / name, files[name])


def verify_file(file: Path, expected: list[int], data: bytes | None = None) -> None:
    """``file`` (or its already read ``data``) against ``[crc32, size]`` from the marker."""
    if data is None:
        if not file.is_file():
            raise GraphshardRuntimeError(
                f"Checkpoint file {file} is missing (the commit marker lists it).")
        crc, size = file_crc32(file)
    else:
        crc, size = zlib.crc32(data), len(data)
    if [crc, size] != list(expected):
        raise GraphshardRuntimeError(
            f"Checkpoint file {file} is corrupt: CRC-32 {crc:08x} and {size} bytes, the "
            f"commit marker says {expected[0]:08x} and {expected[1]} bytes. Nothing was "
            "loaded; load an earlier checkpoint (pass its step_N directory)."
        )


# --------------------------------------------------------------------------- commit order


def read_marker(path: Path) -> dict[str, Any]:
    """The commit marker of the checkpoint directory ``path`` ({} when it holds no JSON
    object: markers of format 1 and 2 may hold nothing)."""
    try:
        marker = json.loads((path / COMMIT_MARKER).read_bytes() or b"{}")
    except ValueError:
        return {}
    return marker if isinstance(marker, dict) else {}


def identity(path: Path) -> str:
    """Which committed checkpoint ``path`` is: its name and a hash of its marker."""
    digest = hashlib.sha1((path / COMMIT_MARKER).read_bytes()).hexdigest()[:16]
    return f"{path.name}#{digest}"


def order_key(path: Path, marker: dict[str, Any]) -> tuple:
    """Commit order: the commit counter, then the commit time, then the step (markers
    written before the counter existed sort first, by time, then step)."""
    match = _STEP_DIR.match(path.name) or _OLD_DIR.match(path.name)
    step = int(match.group(1)) if match else -1
    return (int(marker.get("seq", 0)), float(marker.get("time", 0.0)), step)


def committed(root: Path) -> list[Path]:
    """The committed checkpoints under ``root``, oldest commit first: every ``step_N``
    holding the marker, and a ``.old-step_N`` (a replaced step whose replacement did not
    land) where ``step_N`` is not committed."""
    if not root.is_dir():
        return []
    found: dict[str, Path] = {}
    children = list(root.iterdir())
    for child in children:
        if _STEP_DIR.match(child.name) and (child / COMMIT_MARKER).is_file():
            found[child.name] = child
    for child in children:
        match = _OLD_DIR.match(child.name)
        if match and child.name[len(".old-"):] not in found and (child / COMMIT_MARKER).is_file():
            found[child.name] = child
    return sorted(found.values(), key=lambda p: order_key(p, read_marker(p)))


def next_seq(root: Path) -> int:
    """The commit counter of the next commit under ``root``."""
    return 1 + max((int(read_marker(p).get("seq", 0)) for p in committed(root)), default=0)


# --------------------------------------------------------------------------- graphshard.pt


_SAFE_HINT = (
    "tensors, dicts, lists, tuples, str, int, float, bool, None (e.g. an LR scheduler's "
    "state_dict(), a data loader position)"
)


def _weights_only_error(obj: Any) -> tuple[bytes, str | None]:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # what the loader would refuse
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return data, next((ln for ln in lines if "Unsupported" in ln or "GLOBAL" in ln),
                          lines[0] if lines else type(exc).__name__)
    return data, None


def serialize_meta(meta: dict[str, Any]) -> bytes:
    """``graphshard.pt``'s bytes, refused unless ``torch.load(weights_only=True)`` reads
    them back (so loading a checkpoint never runs code from it)."""
    try:
        _, why = _weights_only_error(meta.get("extra"))
    except Exception as exc:  # not picklable at all
        why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        raise GraphshardValueError(
            "save_checkpoint's extra must hold only what torch.load(weights_only=True) "
            f"accepts: {_SAFE_HINT}. It holds something else: {why}"
        )
    data, why = _weights_only_error(meta)
    if why is not None:
        raise GraphshardValueError(
            "The optimizer's param groups or state hold a value torch.load(weights_only=True) "
            f"refuses, so the checkpoint could not be loaded safely: {why}"
        )
    return data


def load_meta(data: bytes) -> dict[str, Any]:
    """``graphshard.pt``'s content, read with ``weights_only=True``."""
    return torch.load(io.BytesIO(data), weights_only=True)
