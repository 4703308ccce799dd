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
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from graphshard.api.sharding import shard_state
from graphshard.errors import (
    CheckpointMismatchError,
    GraphshardFileNotFoundError,
    GraphshardRuntimeError,
    GraphshardValueError,
)
from graphshard.records import ShardState

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
FORMAT = 2
_STEP_DIR = re.compile(r"^step_(\d+)$")
_OLD_DIR = re.compile(r"^\.old-step_(\d+)$")
_MODEL, _OPTIM = "model/", "optim/"


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


def root_module(module: nn.Module) -> nn.Module:
    """The module a ``torch.compile`` wrapper wraps (``module`` itself otherwise)."""
    return getattr(module, "_orig_mod", module)


def _flat_state(module: nn.Module, optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """The DCP state dict (``model/<name>``, ``optim/<name>/<key>``) from torch's
    ``get_model_state_dict`` / ``get_optimizer_state_dict``, and the metadata that goes into
    ``graphshard.pt`` (param groups, which optimizer entries are tensors)."""
    root = root_module(module)
    flat: dict[str, Any] = {
        _MODEL + k: v for k, v in get_model_state_dict(root).items()
        if isinstance(v, torch.Tensor)
    }  # fmt: skip
    meta: dict[str, Any] = {"optimizer": optimizer is not None}
    if optimizer is not None:
        _check_optimizer_params(root, optimizer)
        osd = get_optimizer_state_dict(root, optimizer)
        layout: dict[str, str] = {}
        objects: dict[str, Any] = {}
        for fqn, per in osd["state"].items():
            for key, value in per.items():
                flat_key = f"{_OPTIM}{fqn}/{key}"
                if isinstance(value, torch.Tensor):  # "dtensor": laid out like its parameter
                    layout[flat_key] = "dtensor" if isinstance(value, DTensor) else "tensor"
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
        raise GraphshardValueError(f"keep_last must be >= 1 or None, got {keep_last}")
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
        raise GraphshardRuntimeError(f"Committing checkpoint {final} failed on rank 0: {error[0]}")
    return final


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
    full_shape = {e.names[0]: tuple(e.param.shape) for e in state.params}  # global (TP too)
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
    if bad:
        raise CheckpointMismatchError(
            "The checkpoint's optimizer state does not fit the model:\n  "
            + "\n  ".join(bad[:20]) + f"\n{hint}"
        )


# Optimizer entry kinds in ``graphshard.pt``: laid out like the parameter (a DTensor), a plain
# tensor (``step``), a non-tensor object. Format 1 called the first two sharded and scalar.
_DTENSOR_KINDS, _TENSOR_KINDS = ("dtensor", "sharded"), ("tensor", "scalar")


def _empty_like_saved(md, kind: str, param: torch.Tensor) -> torch.Tensor:
    """A fresh tensor to read a saved optimizer entry into: a DTensor of ``param``'s spec
    for per-parameter state, else a plain tensor on the CPU (``step``, where optimizers keep
    it by default; loading moves it for capturable/fused ones)."""
    if kind in _DTENSOR_KINDS:
        return torch.empty_like(param, dtype=md.properties.dtype)
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


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
    root = root_module(module)
    state = shard_state(root)
    meta = torch.load(path / META_FILE, weights_only=False)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    _validate(root, optimizer, saved, meta, path)

    live = {k: v for k, v in root.state_dict().items() if isinstance(v, torch.Tensor)}
    targets: dict[str, Any] = {
        _MODEL + name: torch.empty_like(value, dtype=saved[_MODEL + name].properties.dtype)
        for name, value in live.items()
    }  # fmt: skip
    if optimizer is not None:
        param_of = {e.names[0]: e.param for e in state.params}
        for key, kind in meta["layout"].items():
            if kind != "object":
                fqn = key[len(_OPTIM):].rsplit("/", 1)[0]
                targets[key] = _empty_like_saved(saved[key], kind, param_of[fqn])
    dcp.load(targets, checkpoint_id=str(path), process_group=process_group)

    set_model_state_dict(root, {name: targets[_MODEL + name] for name in live})
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
