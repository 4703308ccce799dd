"""Full (unsharded) weights into a sharded model, checked before anything is written.

torch's ``set_model_state_dict(..., StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True))`` sends each rank its rows, tensor by tensor, and stops at the
first tensor it cannot copy (with an error that names no key), leaving the model half
loaded. :func:`load_full_checkpoint` reads on rank 0 only, checks every key and shape against
the model on every rank, raises :class:`~graphshard.CheckpointMismatchError` naming them
all when anything differs (nothing written), and only then calls torch's function. Other
readers (Hugging Face safetensors, :mod:`graphshard.state.hf`) plug in through
:func:`broadcast_full_state`.

Memory: rank 0 holds the full state dict (``torch.load(mmap=True)`` maps it from the file);
every other rank holds its shards plus one full tensor in flight.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from graphshard.errors import GraphshardFileNotFoundError
from graphshard.state.checkpoint import CheckpointMismatchError, check_keys_and_shapes, root_module

__all__ = ["load_full_checkpoint", "broadcast_full_state", "plan_keys", "tied_names", "agree"]

T = TypeVar("T")


def tied_names(module: nn.Module) -> list[list[str]]:
    """The state-dict names of each tensor that has more than one (tied weights), in the
    order ``state_dict()`` lists them."""
    names: dict[int, list[str]] = {}
    tensors = (*module.named_parameters(remove_duplicate=False),
               *module.named_buffers(remove_duplicate=False))
    for name, t in tensors:
        names.setdefault(id(t), []).append(name)
    order = {k: i for i, k in enumerate(module.state_dict())}
    groups = [[n for n in g if n in order] for g in names.values()]
    return [sorted(g, key=order.__getitem__) for g in groups if len(g) > 1]


Hint = str | Callable[[list[str], dict[str, tuple[int, ...]]], str]


def plan_keys(module: nn.Module, found: dict[str, tuple[int, ...]], *, strict: bool,
              what: str, hint: Hint) -> list[str]:
    """Check ``found`` (a source's names and shapes) against ``module``'s state dict and
    return the keys to load. One name of a tied tensor suffices (a source may store it
    once); with ``strict=False`` only the names both have are compared (shapes still are).
    Raises :class:`CheckpointMismatchError` naming every difference; ``hint`` (or
    ``hint(missing_keys, found)``) says what to do about it."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()
                if isinstance(v, torch.Tensor)}
    for group in tied_names(module):
        stored = [n for n in group if n in found] or group[:1]
        for name in group:
            if name not in stored:
                expected.pop(name, None)
    if not strict:
        expected = {k: v for k, v in expected.items() if k in found}
        found = {k: v for k, v in found.items() if k in expected}
    if callable(hint):
        hint = hint([k for k in expected if k not in found], found)
    check_keys_and_shapes(expected, found, what=what, hint=hint)
    return list(expected)


def _rebuild(kind: type, text: str) -> BaseException:
    """An error of type ``kind`` with message ``text`` where it can be built, else a
    RuntimeError naming the type."""
    try:
        return kind(text)
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{kind.__name__}: {text}")


def agree(check: Callable[[], T]) -> T:
    """``check()`` on every rank; if it raised on any, raise on every rank (this rank's own
    error, or the first failing rank's), so no rank goes on into a collective alone."""
    try:
        result, error = check(), None
    except Exception as exc:  # noqa: BLE001  (raised below, on every rank)
        result, error = None, exc
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        errors: list = [None] * dist.get_world_size()
        dist.all_gather_object(errors, None if error is None else (type(error), str(error)))
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed and error is None:
            rank, (kind, text) = failed[0]
            error = _rebuild(kind, f"(raised on rank {rank}) {text}")
    if error is not None:
        raise error
    return result  # type: ignore[return-value]


def broadcast_full_state(
    module: nn.Module,
    read_on_rank0: Callable[[], dict[str, torch.Tensor]],
    *,
    strict: bool,
    what: str,
    hint: Hint,
) -> list[str]:
    """Rank 0 runs ``read_on_rank0()``; every rank checks its names and shapes against
    ``module``; then torch's ``set_model_state_dict(broadcast_from_rank0=True)`` sends each
    rank its rows. A collective over the default group. Returns the keys loaded.

    A failure to read on rank 0, or a mismatch, raises on every rank before anything is
    written (``what`` and ``hint`` word the :class:`CheckpointMismatchError`)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    root = root_module(module)
    rank = dist.get_rank()
    full: dict[str, torch.Tensor] = {}
    shapes: dict[str, tuple[int, ...]] | None = None
    if rank == 0:  # read everything before the first collective: a failure cannot hang
        full = agree(read_on_rank0)
        shapes = {k: tuple(v.shape) for k, v in full.items() if isinstance(v, torch.Tensor)}
    else:
        agree(lambda: None)
    message = [shapes]
    dist.broadcast_object_list(message, src=0)
    keys = agree(lambda: plan_keys(root, message[0], strict=strict, what=what, hint=hint))
    if rank == 0:  # what torch's load wants: every name of a tied tensor, nothing else
        full = {k: full[k] for k in keys}
        for group in tied_names(root):
            stored = next((n for n in group if n in full), None)
            for name in group:
                if stored is not None:
                    full.setdefault(name, full[stored])
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)
    set_model_state_dict(root, full if rank == 0 else {}, options=options)
    return keys


def load_full_checkpoint(
    module: nn.Module, path: str | os.PathLike, *, strict: bool = True
) -> list[str]:
    """Load a full state dict saved with ``torch.save`` (what ``get_model_state_dict(...,
    full_state_dict=True)`` returns, e.g. ``examples/train_llama.py --save``) into a sharded
    model. Rank 0 alone reads ``path`` (memory-mapped); each rank gets its rows.

    A collective: every rank of the default process group calls it, with the same ``path``
    (only rank 0 opens it).

    Args:
        module: the sharded model (or its ``torch.compile`` wrapper), storage allocated
            (after ``to_empty`` when built on the meta device).
        path: the file.
        strict: every key of the model must be in the file and the reverse; False loads
            the keys both have. Shapes must match either way.

    Returns:
        The state-dict keys loaded.

    Raises:
        CheckpointMismatchError: on every rank, naming every missing, unexpected and
            mis-shaped key; nothing was written.
        FileNotFoundError: (on every rank) rank 0 cannot find ``path``.
    """
    path = Path(path)

    def read() -> dict[str, torch.Tensor]:
        if not path.is_file():
            raise GraphshardFileNotFoundError(f"No full checkpoint file at {path}.")
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if not isinstance(state, dict):
            raise CheckpointMismatchError(
                f"{path} holds a {type(state).__name__}, not a state dict: save one with "
                "torch.save(get_model_state_dict(model, options=StateDictOptions("
                "full_state_dict=True, cpu_offload=True)), path)."
            )
        return state

    return broadcast_full_state(
        module, read, strict=strict, what="checkpoint file",
        hint=f"{path} holds the weights of another model (or another config of it): build "
             "the model it was saved from, or pass strict=False to load the keys both have.",
    )  # fmt: skip
