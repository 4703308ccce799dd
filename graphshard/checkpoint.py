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

Parameters are stored with their full (unpadded) shapes as ``Shard(0)`` DTensors, so a
checkpoint saved at one world size loads at any other.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from graphshard.sharded_state import (
    check_param_groups,
    live_param_groups,
    load_sharded_optim_state_dict,
    load_sharded_state_dict,
    optimizer_params,
    sharded_optim_state_dict,
    sharded_state_dict,
)
from graphshard.sharding import shard_state
from graphshard.state_dict import (
    StateDictMismatchError,
    _buffers,
    _dtensor,
    _param_names,
    _root,
    _shard_coords,
    check_keys_and_shapes,
    is_dtensor,
    valid_rows,
)

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "COMMIT_MARKER",
]

COMMIT_MARKER = "COMMITTED"
META_FILE = "graphshard.pt"
FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_OLD_DIR = re.compile(r"^\.old-step_(\d+)$")
_MODEL, _OPTIM = "model/", "optim/"


class CheckpointMismatchError(StateDictMismatchError):
    """A checkpoint does not fit the model or optimizer it is loaded into (nothing was
    written to them)."""


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
    """The complete checkpoint (``step_N`` holding the commit marker) of the highest step
    under ``directory``, or None. Interrupted saves (``.tmp-*``) are ignored."""
    root = Path(directory)
    if not root.is_dir():
        return None
    found: dict[int, Path] = {}
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / COMMIT_MARKER).is_file():
            found[int(match.group(1))] = child
    for child in root.iterdir():  # a replaced step whose replacement did not land
        match = _OLD_DIR.match(child.name)
        if match and int(match.group(1)) not in found and (child / COMMIT_MARKER).is_file():
            found[int(match.group(1))] = child
    return found[max(found)] if found else None


def _flat_state(module: nn.Module, optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DCP state dict (``model/<name>``, ``optim/<name>/<key>``) and the metadata that
    goes into ``graphshard.pt`` (param groups, which optimizer entries are sharded)."""
    flat: dict[str, Any] = {
        _MODEL + k: v for k, v in sharded_state_dict(module).items() if isinstance(v, torch.Tensor)
    }
    meta: dict[str, Any] = {"optimizer": optimizer is not None}
    if optimizer is not None:
        osd = sharded_optim_state_dict(module, optimizer)
        layout: dict[str, str] = {}
        objects: dict[str, Any] = {}
        for fqn, per in osd["state"].items():
            for key, value in per.items():
                flat_key = f"{_OPTIM}{fqn}/{key}"
                if is_dtensor(value):
                    layout[flat_key] = "sharded"
                    flat[flat_key] = value
                elif isinstance(value, torch.Tensor):
                    layout[flat_key] = "scalar"
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
) -> Path:
    """Save a sharded checkpoint of ``module`` (and ``optimizer``) as ``directory/step_N``.

    A collective: every rank calls it; each rank writes only its own shard rows (DCP).
    The checkpoint becomes visible atomically (temporary directory, commit marker written
    last, rename), so an interrupted save never damages earlier checkpoints.

    Args:
        directory: the checkpoint root, on a file system every rank sees.
        module: the sharded model (or its compiled wrapper).
        optimizer: an optimizer built on ``module.parameters()`` after sharding, or None.
        step: the training step this state is after; names the checkpoint (``step_N``).
        extra: any picklable object saved from rank 0 (LR scheduler state, data position).
        keep_last: after the commit, delete all but the newest ``keep_last`` checkpoints.
        process_group: the ranks that save together (default: the default group).

    Returns:
        The committed checkpoint's path.
    """
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 or None, got {keep_last}")
    _refuse_held_back_gradients(module)
    root = Path(directory)
    final = root / _step_name(step)
    tmp = root / f".tmp-{final.name}"
    is_coordinator = dist.get_rank(process_group) == 0
    flat, meta = _flat_state(module, optimizer)
    if is_coordinator:
        shutil.rmtree(tmp, ignore_errors=True)  # a stale, interrupted save of this step
        tmp.mkdir(parents=True)
    dist.barrier(group=process_group)
    import torch.distributed.checkpoint as dcp

    dcp.save(flat, checkpoint_id=str(tmp), process_group=process_group)
    error: list[Any] = [None]
    if is_coordinator:
        try:
            _commit(root, tmp, final, step, meta, extra, dist.get_world_size(process_group))
            if keep_last is not None:
                _prune(root, keep_last)
        except Exception as exc:  # every rank must learn that the commit failed
            error = [f"{type(exc).__name__}: {exc}"]
    dist.broadcast_object_list(error, src=dist.get_global_rank(process_group or
                                                               dist.group.WORLD, 0),
                               group=process_group)
    if error[0] is not None:
        raise RuntimeError(f"Committing checkpoint {final} failed on rank 0: {error[0]}")
    return final


def _refuse_held_back_gradients(module: nn.Module) -> None:
    """A checkpoint holds parameters and optimizer state, not gradients: saving inside a
    no_sync accumulation window would silently drop the micro-batches held back so far."""
    held = [e.names[0] for e in shard_state(module).params
            for leaf in (e.unreduced, e.partial) if leaf is not None and leaf.grad is not None]
    if held:
        raise RuntimeError(
            f"Gradients of {len(held)} parameter(s) (e.g. {held[0]!r}) are held back by "
            "graphshard.no_sync and would not be in the checkpoint. Save after the synced "
            "backward and optimizer.step() that end the accumulation window."
        )


def _commit(root: Path, tmp: Path, final: Path, step: int, meta: dict, extra: Any,
            world_size: int) -> None:
    meta = {**meta, "format": FORMAT, "step": step, "extra": extra, "world_size": world_size}
    with open(tmp / META_FILE, "wb") as f:
        torch.save(meta, f)
        f.flush()
        os.fsync(f.fileno())
    marker = {"step": step, "world_size": world_size, "time": time.time()}
    _write_durable(tmp / COMMIT_MARKER, json.dumps(marker).encode())
    _fsync_dir(tmp)
    old = root / f".old-{final.name}"
    if final.exists():  # saving the same step again: keep the old one until the new lands
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep_last: int) -> None:
    steps = sorted(
        (int(m.group(1)), child)
        for child in root.iterdir()
        if (m := _STEP_DIR.match(child.name)) and (child / COMMIT_MARKER).is_file()
    )
    for _, path in steps[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def _resolve(path: Path) -> Path:
    if (path / COMMIT_MARKER).is_file():
        return path
    if path.is_dir() and (_STEP_DIR.match(path.name) or path.name.startswith(".tmp-")):
        raise FileNotFoundError(
            f"{path} has no {COMMIT_MARKER} marker: its save did not finish. Load the "
            f"checkpoint root {path.parent} to get the latest complete checkpoint."
        )
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(
            f"No complete checkpoint under {path} (looked for step_N/{COMMIT_MARKER})."
        )
    return latest


def _shape(md) -> tuple[int, ...] | None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None


def _validate(root_module, optimizer, saved: dict, meta: dict, path: Path) -> None:
    """Every key and shape of the model (and optimizer) against the checkpoint, before any
    write."""
    state = shard_state(root_module)
    hint = (
        f"The checkpoint {path} was saved from a different model (saved at world size "
        f"{meta.get('world_size')}; world sizes may differ, names and shapes may not). "
        "Load it into the model it was saved from, or start without --resume."
    )
    expected = {k: tuple(e.full_shape) for k, e in _param_names(state).items()}
    expected.update({k: tuple(v.shape) for k, v in _buffers(root_module, state).items()})
    found = {
        k[len(_MODEL):]: (_shape(v) if _shape(v) is not None else ("<object>",))
        for k, v in saved.items()
        if k.startswith(_MODEL)
    }
    try:
        check_keys_and_shapes(expected, found, what="checkpoint", hint=hint)
    except StateDictMismatchError as exc:
        raise CheckpointMismatchError(str(exc)) from None
    if optimizer is None:
        return
    if not meta.get("optimizer"):
        raise CheckpointMismatchError(
            f"The checkpoint {path} holds no optimizer state: load it with optimizer=None "
            "(and start the optimizer fresh)."
        )
    params = optimizer_params(root_module, optimizer)
    try:
        check_param_groups(live_param_groups(optimizer, params),
                           [g["params"] for g in meta["param_groups"]])
    except StateDictMismatchError as exc:
        raise CheckpointMismatchError(str(exc)) from None
    full_shape = {op.fqn: tuple(op.entry.full_shape) for op in params}
    bad = []
    for key, kind in meta["layout"].items():
        fqn = key[len(_OPTIM):].rsplit("/", 1)[0]
        if fqn not in full_shape:
            bad.append(f"{key}: not a parameter of the optimizer")
        elif kind == "sharded" and _shape(saved.get(key)) != full_shape[fqn]:
            bad.append(f"{key}: checkpoint {_shape(saved.get(key))} vs model {full_shape[fqn]}")
        elif kind in ("sharded", "scalar") and key not in saved:
            bad.append(f"{key}: missing from the checkpoint's tensors")
    if bad:
        raise CheckpointMismatchError(
            "The checkpoint's optimizer state does not fit the model:\n  "
            + "\n  ".join(bad[:20]) + f"\n{hint}"
        )


def _empty_like_saved(md, full_shape, state, device):
    rank, world = _shard_coords(state)
    shape = torch.Size(full_shape)
    if len(shape) == 0:
        local = torch.empty((), dtype=md.properties.dtype, device=device)
    else:
        local = torch.empty((valid_rows(shape, world, rank), *shape[1:]),
                            dtype=md.properties.dtype, device=device)
    return _dtensor(local, shape, state)


def load_checkpoint(
    directory: str | os.PathLike,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> CheckpointInfo:
    """Load the latest complete checkpoint under ``directory`` (or ``directory`` itself when
    it is one ``step_N``) into ``module`` and ``optimizer``, at any world size.

    A collective: every rank calls it. Keys and shapes are checked against DCP's metadata
    first; a mismatch raises :class:`CheckpointMismatchError` naming them, with the model
    and optimizer untouched. Tensors are read into fresh buffers and copied into the model
    only once every read succeeded.

    Returns:
        :class:`CheckpointInfo`: the path, step, ``extra`` and the world size it was saved at.
    """
    import torch.distributed.checkpoint as dcp

    path = _resolve(Path(directory))
    root_module = _root(module)
    state = shard_state(root_module)
    meta = torch.load(path / META_FILE, weights_only=False)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    _validate(root_module, optimizer, saved, meta, path)

    device = next((e.shard.device for e in state.params), torch.device("cpu"))
    names = _param_names(state)
    targets: dict[str, Any] = {}
    for entry in state.params:
        key = _MODEL + entry.names[0]
        targets[key] = _empty_like_saved(saved[key], entry.full_shape, state, device)
    for name, buf in _buffers(root_module, state).items():
        md = saved[_MODEL + name]
        targets[_MODEL + name] = torch.empty_like(buf, dtype=md.properties.dtype)
    if optimizer is not None:
        params = {op.fqn: op.entry for op in optimizer_params(root_module, optimizer)}
        for key, kind in meta["layout"].items():
            fqn = key[len(_OPTIM):].rsplit("/", 1)[0]
            md = saved[key]
            if kind == "sharded":
                targets[key] = _empty_like_saved(md, params[fqn].full_shape, state, device)
            elif kind == "scalar":  # ``step``: on the CPU, where optimizers keep it by
                # default; load_state_dict moves it for capturable/fused ones
                targets[key] = torch.empty((), dtype=md.properties.dtype)
    dcp.load(targets, checkpoint_id=str(path), process_group=process_group)

    model_sd = {
        name: targets[_MODEL + entry.names[0]] for name, entry in names.items()
    }
    model_sd.update({n: targets[_MODEL + n] for n in _buffers(root_module, state)})
    load_sharded_state_dict(root_module, model_sd)
    if optimizer is not None:
        osd_state: dict[str, dict[str, Any]] = {}
        for key, kind in meta["layout"].items():
            fqn, sub = key[len(_OPTIM):].rsplit("/", 1)
            value = meta["objects"][key] if kind == "object" else targets[key]
            osd_state.setdefault(fqn, {})[sub] = value
        load_sharded_optim_state_dict(
            root_module, optimizer, {"state": osd_state, "param_groups": meta["param_groups"]}
        )
    return CheckpointInfo(path, int(meta["step"]), meta.get("extra"), int(meta["world_size"]))

