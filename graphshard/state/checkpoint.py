"""Sharded, atomic, resumable checkpoints through ``torch.distributed.checkpoint`` (DCP).

    graphshard.save_checkpoint("ckpt", model, optimizer, step=step, extra={...})
    info = graphshard.load_checkpoint("ckpt", model, optimizer)   # latest complete one
    start = info.step

Layout of ``ckpt/``::

    step_00000300/              one complete checkpoint per saved step
        .metadata, __*_*.distcp DCP's files: each rank wrote only its own rows
        graphshard.pt           step, optimizer param groups, state layout, ``extra``
        COMMITTED               written last; a checkpoint without it is never loaded
    .tmp-step_00000400/         a save in progress (or interrupted): ignored

A save writes into ``.tmp-step_N``, rank 0 writes ``graphshard.pt`` and then the
``COMMITTED`` marker, and only then renames the directory to ``step_N`` (an atomic rename
on one file system). A rank killed at any moment leaves at worst a ``.tmp-`` directory, and
the previous checkpoints untouched and loadable. Loading reads DCP's metadata first and
checks every key and shape against the model (and optimizer) before it writes anything.

The tensors are what torch's own ``get_model_state_dict`` / ``get_optimizer_state_dict``
return for the sharded model: DTensors of the full shapes (``Shard(0)``), so a checkpoint
saved at one world size loads at any other, and torch's ``set_model_state_dict`` /
``set_optimizer_state_dict`` load them. What this module adds is what torch lacks: the
atomic commit, ``keep_last``, ``latest_checkpoint``, and the check of every key and shape
before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import empty as distributed_empty

from graphshard.api.optimizer_steps import reduced_state_placements
from graphshard.api.sharding import is_sharded, shard_state
from graphshard.errors import (
    CheckpointMismatchError,
    GraphshardFileNotFoundError,
    GraphshardRuntimeError,
    GraphshardValueError,
)
from graphshard.records import ShardState
from graphshard.state import ckpt_integrity as integrity
from graphshard.state.ckpt_integrity import COMMIT_MARKER

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "COMMIT_MARKER",
]

META_FILE = "graphshard.pt"
FORMAT = 3  # 3: per-rank buffers, optimizer type, commit counter and checksums
_STEP_DIR = integrity._STEP_DIR
_MODEL, _OPTIM = "model/", "optim/"
_RANK_BUFFERS = "rank_buffers/{}/"  # + buffer name: each rank's own copy of a buffer


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`load_checkpoint` loaded: where from, the step and the saved ``extra``."""

    path: Path
    step: int
    extra: Any
    world_size: int


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The latest committed checkpoint under ``directory`` (a ``step_N`` holding the commit
    marker), or None. Latest in commit order (the marker's commit counter), not by step
    number: after a roll-back, the checkpoint saved last wins. Interrupted saves (``.tmp-*``)
    are ignored. Local: it reads this rank's view of the file system (``load_checkpoint``
    has rank 0 decide for every rank)."""
    found = integrity.committed(Path(directory))
    return found[-1] if found else None


def root_module(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper wraps (``module`` itself otherwise)."""
    return getattr(module, "_orig_mod", module)


def _optimizer_type(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def _flat_state(module: nn.Module, optimizer, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DCP state dict (``model/<name>``, ``optim/<name>/<key>``) from torch's
    ``get_model_state_dict`` / ``get_optimizer_state_dict``, and the metadata that goes into
    ``graphshard.pt`` (param groups, which optimizer entries are tensors).

    A plain (not DTensor) tensor, i.e. a buffer such as BatchNorm's running stats, may
    differ between ranks: each rank saves its own as ``rank_buffers/<rank>/<name>``, and
    rank 0's is also ``model/<name>`` (what a load at another world size, or a plain
    ``dcp.load``, reads)."""
    root = root_module(module)
    flat: dict[str, Any] = {}
    buffers: list[str] = []
    for k, v in get_model_state_dict(root).items():
        if not isinstance(v, torch.Tensor):
            continue
        if isinstance(v, DTensor):
            flat[_MODEL + k] = v
            continue
        buffers.append(k)
        flat[_RANK_BUFFERS.format(rank) + k] = v
        if rank == 0:
            flat[_MODEL + k] = v
    meta: dict[str, Any] = {"optimizer": optimizer is not None, "rank_buffers": buffers}
    if optimizer is not None:
        _check_optimizer_params(root, optimizer)
        meta["optimizer_type"] = _optimizer_type(optimizer)
        osd = get_optimizer_state_dict(root, optimizer)
        full_shape = _full_shapes(shard_state(root))
        layout: dict[str, str] = {}
        objects: dict[str, Any] = {}
        for fqn, per in osd["state"].items():
            for key, value in per.items():
                flat_key = f"{_OPTIM}{fqn}/{key}"
                if isinstance(value, torch.Tensor):
                    layout[flat_key] = _tensor_kind(value, full_shape.get(fqn))
                    flat[flat_key] = value
                else:
                    layout[flat_key] = "object"
                    objects[flat_key] = value
        meta.update(param_groups=osd["param_groups"], layout=layout, objects=objects)
    return flat, meta


def save_checkpoint(
    directory: str | os.PathLike,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    extra: Any = None,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    arrival_timeout_s: float | None = 60.0,
) -> Path:
    """Save a sharded checkpoint of ``module`` (and ``optimizer``) as ``directory/step_N``.

    A collective: every rank calls it, with the same ``directory`` and ``step``; each rank
    writes only its own shard rows (DCP), and its own copy of each buffer. The checkpoint
    becomes visible atomically (temporary directory, commit marker written last, rename), so
    an interrupted save never damages earlier checkpoints; saving an existing step again
    replaces it atomically. An error on any rank, at any stage, is raised on every rank.

    Args:
        directory: the checkpoint root, on a file system every rank sees.
        module: the sharded model (or its compiled wrapper).
        optimizer: an optimizer built on ``module.parameters()`` after sharding, or None.
        step: the training step this state is after (an int >= 0); names the checkpoint
            (``step_N``).
        extra: saved from rank 0; only what ``torch.load(weights_only=True)`` reads
            (tensors, dicts, lists, tuples, str, int, float, bool, None: an LR scheduler's
            ``state_dict()``, a data position). Anything else is refused.
        keep_last: after the commit, delete all but the ``keep_last`` most recently
            committed checkpoints (never the one just written).
        process_group: the ranks that save together (default: the default group).
        arrival_timeout_s: with gloo, every rank must enter the save within this many
            seconds of the others, else every rank that did raises (a rank calling it alone
            fails fast instead of waiting the process-group timeout). None: no such check.

    Returns:
        The committed checkpoint's path.
    """
    rank, world = integrity._world(process_group)
    integrity.check_arrival(process_group, arrival_timeout_s, "save_checkpoint")
    # 1. every rank's own checks and state; rank 0 serialises graphshard.pt. No writes yet.
    error: Exception | None = None
    key: Any = None
    flat: dict[str, Any] = {}
    meta_bytes = b""
    try:
        key = (os.path.normpath(os.fspath(directory)), step, _optimizer_steps(module))
        _check_step(step)
        if keep_last is not None and (isinstance(keep_last, bool) or
                                      not isinstance(keep_last, int) or keep_last < 1):
            raise GraphshardValueError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        _refuse_held_back_gradients(module)
        flat, meta = _flat_state(module, optimizer, rank)
        if rank == 0:
            meta_bytes = integrity.serialize_meta(
                {**meta, "format": FORMAT, "step": step, "extra": extra, "world_size": world})
    except Exception as exc:
        error = exc
    keys = integrity.agree(error, process_group, "Preparing the checkpoint", key)
    if any(k[:2] != keys[0][:2] for k in keys):
        raise GraphshardValueError(
            "save_checkpoint needs the same directory and step on every rank; got "
            + "; ".join(f"rank {r}: directory {d!r}, step {s!r}"
                        for r, (d, s, _) in enumerate(keys))
        )
    if any(k[2] != keys[0][2] for k in keys):
        raise GraphshardRuntimeError(
            "save_checkpoint: the ranks' shards hold different training steps (optimizer steps "
            "taken on this model: " + ", ".join(f"rank {r}: {k[2]}" for r, k in enumerate(keys))
            + "). Every rank must call optimizer.step() on every step; nothing was written."
        )
    root = Path(directory)
    final = root / _step_name(step)
    tmp = root / f".tmp-{final.name}"
    # 2. rank 0 makes the temporary directory
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)  # a stale, interrupted save of this step
            tmp.mkdir(parents=True)
        except Exception as exc:
            error = exc
    integrity.agree(error, process_group, f"Creating {tmp}")
    # 3. every rank writes its rows (DCP), then checksums the files it wrote
    import torch.distributed.checkpoint as dcp

    error, sums = None, {}
    writer = integrity.RecordingWriter(str(tmp))
    try:
        dcp.save(flat, storage_writer=writer, process_group=process_group)
        sums = {name: list(integrity.file_crc32(tmp / name)) for name in writer.written}
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        error = exc
    gathered = integrity.agree(error, process_group, f"Writing {tmp}", sums)
    # 4. rank 0 commits (and prunes); every rank learns whether that worked
    error = None
    if rank == 0:
        try:
            files = {k: v for per_rank in gathered for k, v in per_rank.items()}
            _commit(root, tmp, final, step, meta_bytes, files, world)
            if keep_last is not None:
                _prune(root, keep_last, final)
        except Exception as exc:
            error = exc
    integrity.agree(error, process_group, f"Committing checkpoint {final}")
    return final


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise GraphshardValueError(
            f"step must be an int >= 0 (it names the checkpoint step_N), got {step!r}")


def _optimizer_steps(module: nn.Module) -> int | None:
    """The optimizer steps taken on a sharded model's parameters (None if not sharded)."""
    return shard_state(module).optimizer_steps if is_sharded(module) else None


def _refuse_held_back_gradients(module: nn.Module) -> None:
    """A checkpoint holds parameters and optimizer state, not gradients: saving inside a
    no_sync accumulation window would silently drop the micro-batches held back so far."""
    held = [e.names[0] for e in shard_state(module).params
            for leaf in (e.unreduced, e.partial) if leaf is not None and leaf.grad is not None]
    if held:
        raise GraphshardRuntimeError(
            f"Gradients of {len(held)} parameter(s) (e.g. {held[0]!r}) are held back by "
            "graphshard.no_sync and would not be in the checkpoint. Save after the synced "
            "backward and optimizer.step() that end the accumulation window."
        )


def _commit(root: Path, tmp: Path, final: Path, step: int, meta_bytes: bytes,
            files: dict[str, list[int]], world_size: int) -> None:
    """Write ``graphshard.pt`` and the commit marker (commit counter, checksum of every
    file), then rename ``tmp`` to ``final`` (replacing an earlier save of the same step)."""
    _write_durable(tmp / META_FILE, meta_bytes)
    files = {**files, META_FILE: [zlib.crc32(meta_bytes), len(meta_bytes)]}
    for child in tmp.iterdir():  # DCP's .metadata, and anything no rank reported
        if child.is_file() and child.name not in files:
            files[child.name] = list(integrity.file_crc32(child))
    marker = {"format": FORMAT, "step": step, "world_size": world_size, "time": time.time(),
              "seq": integrity.next_seq(root), "checksum": "crc32", "files": files}
    _write_durable(tmp / COMMIT_MARKER, json.dumps(marker, sort_keys=True).encode())
    _fsync_dir(tmp)
    old = root / f".old-{final.name}"
    if final.exists():  # saving the same step again: keep the old one until the new lands
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep_last: int, just_written: Path) -> None:
    """Delete all but the ``keep_last`` most recently committed ``step_N`` (commit order),
    never ``just_written``."""
    found = [p for p in integrity.committed(root) if _STEP_DIR.match(p.name)]
    for path in found[:-keep_last]:
        if path != just_written:
            shutil.rmtree(path, ignore_errors=True)


def _resolve(path: Path) -> Path:
    if (path / COMMIT_MARKER).is_file():
        return path
    if path.is_dir() and (_STEP_DIR.match(path.name) or path.name.startswith(".tmp-")):
        raise GraphshardFileNotFoundError(
            f"{path} has no {COMMIT_MARKER} marker: its save did not finish. Load the "
            f"checkpoint root {path.parent} to get the latest complete checkpoint."
        )
    latest = latest_checkpoint(path)
    if latest is None:
        raise GraphshardFileNotFoundError(
            f"No complete checkpoint under {path} (looked for step_N/{COMMIT_MARKER})."
        )
    return latest


def _shape(md) -> tuple[int, ...] | None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None


def _describe(problems: dict[str, list[str]], what: str, hint: str) -> str:
    lines = [f"{what} does not fit the model:"]
    for title, items in problems.items():
        if items:
            more = f" ... and {len(items) - 20} more" if len(items) > 20 else ""
            lines.append(f"  {title} ({len(items)}): " + ", ".join(items[:20]) + more)
    lines.append(hint)
    return "\n".join(lines)


def check_keys_and_shapes(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], *, what: str,
    hint: str,
) -> None:
    """Raise :class:`CheckpointMismatchError` naming missing, unexpected and mis-shaped keys."""
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    shapes = [
        f"{k}: {what} {tuple(found[k])} vs model {tuple(v)}"
        for k, v in expected.items()
        if k in found and tuple(found[k]) != tuple(v)
    ]
    if missing or unexpected or shapes:
        problems = {
            f"missing from the {what}": missing,
            "not in the model": unexpected,
            "shape differs": shapes,
        }
        raise CheckpointMismatchError(_describe(problems, what, hint))


def _param_fqns(state: ShardState, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The model name of each parameter in each of the optimizer's groups."""
    name_of = {id(e.param): e.names[0] for e in state.params}
    return [[name_of.get(id(p), "<not a parameter of this model>") for p in g["params"]]
            for g in optimizer.param_groups]


def _check_optimizer_params(root: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every parameter the optimizer steps is one of the sharded model's."""
    state = shard_state(root)
    ours = {id(e.param) for e in state.params}
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) in ours:
                continue
            replaced = getattr(p, "_graphshard_replaced", None)
            why = (
                f"it is the unsharded parameter {replaced!r} from before graphshard.shard(): "
                "build the optimizer after sharding, on model.parameters()"
                if replaced else "it is not a parameter of this sharded model"
            )  # fmt: skip
            raise GraphshardValueError(
                f"Optimizer param_groups[{gi}]['params'][{pi}] (shape {tuple(p.shape)}) "
                f"cannot be checkpointed with this model: {why}."
            )


def _check_param_groups(live: list[list[str]], saved: list[list[str]], hint: str) -> None:
    if [list(g) for g in live] == [list(g) for g in saved]:
        return
    problems = []
    if len(live) != len(saved):
        problems.append(f"{len(saved)} param group(s) saved, the optimizer has {len(live)}")
    for i, (a, b) in enumerate(zip(live, saved, strict=False)):
        if a != b:
            gone = [n for n in b if n not in a]
            new = [n for n in a if n not in b]
            detail = (f"saved only: {gone[:10]}; optimizer only: {new[:10]}" if gone or new
                      else "same names, different order")
            problems.append(f"param_groups[{i}]: {detail}")
    raise CheckpointMismatchError(
        "The optimizer's parameters do not match the saved optimizer state: "
        + "; ".join(problems)
        + ". Build the optimizer on the same parameters, in the same groups, as when saving. "
        + hint
    )


def _validate(root: nn.Module, optimizer, saved: dict, meta: dict, path: Path) -> None:
    """Every key and shape of the model (and optimizer) against the checkpoint, before any
    write."""
    hint = (
        f"The checkpoint {path} was saved from a different model (saved at world size "
        f"{meta.get('world_size')}; world sizes may differ, names and shapes may not). "
        "Load it into the model it was saved from, or start without --resume."
    )
    expected = {k: tuple(v.shape) for k, v in root.state_dict().items()
                if isinstance(v, torch.Tensor)}
    found = {
        k[len(_MODEL):]: (_shape(v) if _shape(v) is not None else ("<object>",))
        for k, v in saved.items()
        if k.startswith(_MODEL)
    }
    check_keys_and_shapes(expected, found, what="checkpoint", hint=hint)
    if optimizer is None:
        return
    if not meta.get("optimizer"):
        raise CheckpointMismatchError(
            f"The checkpoint {path} holds no optimizer state: load it with optimizer=None "
            "(and start the optimizer fresh)."
        )
    _check_optimizer_params(root, optimizer)
    state = shard_state(root)
    _check_param_groups(_param_fqns(state, optimizer),
                        [g["params"] for g in meta["param_groups"]], hint)
    _check_optimizer_kind(optimizer, meta, path)
    full_shape = _full_shapes(state)
    bad = []
    for key, kind in meta["layout"].items():
        fqn = key[len(_OPTIM):].rsplit("/", 1)[0]
        shape = _shape(saved.get(key))
        if fqn not in full_shape:
            bad.append(f"{key}: not a parameter of the optimizer")
        elif kind != "object" and shape is None:
            bad.append(f"{key}: missing from the checkpoint's tensors")
        elif kind in _DTENSOR_KINDS and shape != full_shape[fqn]:
            bad.append(f"{key}: checkpoint {shape} vs model {full_shape[fqn]}")
        elif kind == _REDUCED and not _reduced_from(shape, full_shape[fqn]):
            bad.append(f"{key}: checkpoint {shape}, which is not the model's "
                       f"{full_shape[fqn]} with dimensions reduced to 1")
    if bad:
        raise CheckpointMismatchError(
            "The checkpoint's optimizer state does not fit the model:\n  "
            + "\n  ".join(bad[:20]) + f"\n{hint}"
        )


def _check_optimizer_kind(optimizer: torch.optim.Optimizer, meta: dict, path: Path) -> None:
    """The same optimizer class, and the same hyper-parameter keys in every param group,
    as when saving (AdamW state in an SGD would fail at its first step)."""
    saved_type, live_type = meta.get("optimizer_type"), _optimizer_type(optimizer)
    if saved_type is not None and saved_type != live_type:
        raise CheckpointMismatchError(
            f"The checkpoint {path} holds the state of a {saved_type}, the optimizer is a "
            f"{live_type}: load it into the same optimizer type, or with optimizer=None "
            "(and start the optimizer fresh)."
        )
    for i, saved in enumerate(meta["param_groups"]):
        missing = sorted(set(optimizer.defaults) - set(saved))
        if missing:  # extra saved keys are fine (an LR scheduler adds "initial_lr")
            raise CheckpointMismatchError(
                f"The checkpoint {path}'s param_groups[{i}] lacks the key(s) {missing} that "
                f"the optimizer ({live_type}) needs: it was saved from another optimizer "
                f"type ({saved_type or 'not recorded'})."
            )


# Optimizer entry kinds in ``graphshard.pt``: laid out like the parameter (a DTensor), a plain
# tensor (``step``), a non-tensor object. Format 1 called the first two sharded and scalar.
# Optimizer state kinds: "dtensor", laid out like its parameter; "reduced", a DTensor whose
# shape is its parameter's with some dimensions reduced to 1 (Adafactor's row and column
# factors), laid out by graphshard.api.optimizer_steps.reduced_state_placements; a plain
# "tensor"; an "object".
_DTENSOR_KINDS, _TENSOR_KINDS = ("dtensor", "sharded"), ("tensor", "scalar")
_REDUCED = "reduced"


def _full_shapes(state: ShardState) -> dict[str, tuple[int, ...]]:
    """Each parameter's global shape (TP's too), by its first name."""
    return {e.names[0]: tuple(e.param.shape) for e in state.params}


def _tensor_kind(value: torch.Tensor, param_shape: tuple[int, ...] | None) -> str:
    if not isinstance(value, DTensor):
        return "tensor"
    if param_shape is not None and tuple(value.shape) != param_shape:
        return _REDUCED
    return "dtensor"


def _reduced_from(shape: tuple[int, ...] | None, param_shape: tuple[int, ...]) -> bool:
    return shape is not None and len(shape) == len(param_shape) and all(
        s in (p, 1) for s, p in zip(shape, param_shape, strict=True))


def _empty_like_saved(md, kind: str, param: torch.Tensor) -> torch.Tensor:
    """A fresh tensor to read a saved optimizer entry into: a DTensor of ``param``'s spec
    for per-parameter state (its reduced shape's placements for a "reduced" one), else a
    plain tensor on the CPU (``step``, where optimizers keep it by default; loading moves it
    for capturable/fused ones)."""
    if kind in _DTENSOR_KINDS:
        return torch.empty_like(param, dtype=md.properties.dtype)
    if kind == _REDUCED:
        size = tuple(md.size)
        return distributed_empty(size, dtype=md.properties.dtype,
                                 device_mesh=param.device_mesh,
                                 placements=reduced_state_placements(param, size))
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


def load_checkpoint(
    directory: str | os.PathLike,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> CheckpointInfo:
    """Load the latest committed checkpoint under ``directory`` (or ``directory`` itself
    when it is one ``step_N``) into ``module`` and ``optimizer``, at any world size.

    A collective: every rank calls it. Rank 0 decides which checkpoint; a rank that does not
    see that same committed checkpoint makes every rank raise, naming both. Before anything
    is written, the ranks verify the checksum of every file of the checkpoint (each rank a
    share of the files) and check every key and shape against DCP's metadata, the optimizer
    type and param groups; a mismatch raises :class:`CheckpointMismatchError` naming them,
    with the model and optimizer untouched, on every rank. Tensors are read into fresh
    buffers and copied into the model only once every read succeeded.

    Buffers (plain tensors such as BatchNorm's running stats): at the world size the
    checkpoint was saved at, each rank gets its own saved copy back; at another world size,
    every rank gets rank 0's.

    Returns:
        :class:`CheckpointInfo`: the path, step, ``extra`` and the world size it was saved at.
    """
    import torch.distributed.checkpoint as dcp

    rank, world = integrity._world(process_group)
    path = _agree_on_checkpoint(Path(directory), process_group)
    root = root_module(module)
    error: Exception | None = None
    try:
        marker = integrity.read_marker(path)
        files = marker.get("files")
        meta_bytes = (path / META_FILE).read_bytes()
        if files is not None:
            integrity.verify_file(path / META_FILE, files[META_FILE], meta_bytes)
            integrity.verify_files(path, {k: v for k, v in files.items() if k != META_FILE},
                                   rank, world)
        meta = integrity.load_meta(meta_bytes)
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        _validate(root, optimizer, saved, meta, path)
        own_buffers = meta.get("world_size") == world and "rank_buffers" in meta
        buffer_key = {name: (_RANK_BUFFERS.format(rank) if own_buffers else _MODEL) + name
                      for name in meta.get("rank_buffers", ())}
        missing = [k for k in buffer_key.values() if k not in saved]
        if missing:
            raise CheckpointMismatchError(f"The checkpoint {path} lacks {missing[:10]}.")
        targets = _targets(root, optimizer, saved, meta, buffer_key)
    except Exception as exc:
        error = exc
    integrity.agree(error, process_group, f"Checking checkpoint {path}")
    dcp.load(targets, checkpoint_id=str(path), process_group=process_group)

    live = [k for k, v in root.state_dict().items() if isinstance(v, torch.Tensor)]
    set_model_state_dict(root, {name: targets[buffer_key.get(name, _MODEL + name)]
                                for name in live})
    if optimizer is not None:
        osd_state: dict[str, dict[str, Any]] = {}
        for key, kind in meta["layout"].items():
            fqn, sub = key[len(_OPTIM):].rsplit("/", 1)
            value = meta["objects"][key] if kind == "object" else targets[key]
            osd_state.setdefault(fqn, {})[sub] = value
        set_optimizer_state_dict(
            root, optimizer, {"state": osd_state, "param_groups": meta["param_groups"]}
        )
    return CheckpointInfo(path, int(meta["step"]), meta.get("extra"), int(meta["world_size"]))


def _targets(root: nn.Module, optimizer, saved: dict, meta: dict,
             buffer_key: dict[str, str]) -> dict[str, Any]:
    """Fresh tensors, laid out like the model's (and optimizer's), for DCP to read into."""
    live = {k: v for k, v in root.state_dict().items() if isinstance(v, torch.Tensor)}
    targets: dict[str, Any] = {}
    for name, value in live.items():
        key = buffer_key.get(name, _MODEL + name)
        targets[key] = torch.empty_like(value, dtype=saved[key].properties.dtype)
    if optimizer is not None:
        param_of = {e.names[0]: e.param for e in shard_state(root).params}
        for key, kind in meta["layout"].items():
            if kind != "object":
                fqn = key[len(_OPTIM):].rsplit("/", 1)[0]
                targets[key] = _empty_like_saved(saved[key], kind, param_of[fqn])
    return targets


def _agree_on_checkpoint(directory: Path, group: dist.ProcessGroup | None) -> Path:
    """The checkpoint every rank loads: rank 0's choice, found committed (same marker) in
    every rank's view of the file system; else every rank raises, naming what each sees."""
    error: Exception | None = None
    mine: Path | None = None
    seen: dict[str, Path] = {}
    try:
        mine = _resolve(directory)
        candidates = [mine] if mine.parent != directory else integrity.committed(directory)
        seen = {integrity.identity(p): p for p in candidates + [mine]}
    except Exception as exc:
        error = exc
    payload = (None if mine is None else integrity.identity(mine), sorted(seen))
    views = integrity.agree(error, group, f"Finding the checkpoint in {directory}", payload)
    chosen = views[0][0]
    blind = [(r, own) for r, (own, ids) in enumerate(views) if chosen not in ids]
    if blind:
        raise GraphshardRuntimeError(
            f"Ranks see different checkpoints in {directory} (a stale shared file-system "
            f"view?): rank 0 chose {chosen}, which rank(s) "
            f"{[r for r, _ in blind]} do not see committed; "
            + "; ".join(f"rank {r} sees {own} as the latest" for r, own in blind)
            + ". Wait until every rank sees the same files, or pass a step_N directory "
            "every rank sees."
        )
    return seen[chosen]
