"""Hugging Face weights into a sharded model: a ``save_pretrained`` directory, by torch's calls.

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    graphshard.shard(model)                          # allocates nothing
    model.to_empty(device="cpu")                     # each rank: its shards, uninitialised
    graphshard.init_non_persistent_buffers(model)    # rotary inv_freq (not in the files)
    graphshard.load_safetensors(model, path)         # each rank reads only its rows

What torch's own calls do not do, and this module adds:

- **Check before writing.** ``set_model_state_dict(..., broadcast_from_rank0=True)`` copies
  tensor by tensor and stops at the first shape it cannot copy, with an error that names no
  key, leaving the model half loaded; ``dcp.load`` names only the first bad key. Here every
  key and shape of the ``*.safetensors`` headers is checked against the model first, and a
  mismatch raises :class:`~graphshard.CheckpointMismatchError` naming every missing,
  unexpected and mis-shaped key on every rank, with nothing written.
- **Tied weights.** ``save_pretrained`` stores a tied weight once (``lm_head.weight`` is
  left out when ``tie_word_embeddings=True``), but the model's ``state_dict()`` holds both
  names, so torch's strict loads report it missing. One name of a tied parameter suffices.
- **Non-persistent buffers** (the rotary ``inv_freq``) are in no file: after
  ``to_empty`` they hold garbage. :func:`init_non_persistent_buffers` recomputes them with
  the model's own ``_init_weights`` (what ``from_pretrained`` does for them) and checks
  that every one was set.

The loading itself is torch's: ``dcp.load`` with ``HuggingFaceStorageReader`` (each rank
reads only its rows through ``safe_open(...).get_slice``), or ``safetensors.torch.load_file``
on rank 0 and ``set_model_state_dict(..., broadcast_from_rank0=True)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from graphshard.errors import (
    GraphshardFileNotFoundError,
    GraphshardRuntimeError,
    GraphshardTypeError,
)
from graphshard.state.checkpoint import CheckpointMismatchError, root_module
from graphshard.state.loading import agree, broadcast_full_state, plan_keys

__all__ = ["load_safetensors", "init_non_persistent_buffers", "safetensors_files"]

_SUFFIX = ".safetensors"
_WHAT = "safetensors checkpoint"


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The ``*.safetensors`` files of a ``save_pretrained`` directory (one file, or the
    shards ``model-0000k-of-0000n.safetensors``): every one in it, as torch's
    ``HuggingFaceStorageReader`` reads them, sorted."""
    root = Path(path)
    if not root.is_dir():
        raise GraphshardFileNotFoundError(
            f"{root} is not a directory (expected a save_pretrained one)."
        )
    files = sorted(p for p in root.iterdir() if p.name.endswith(_SUFFIX) and p.is_file())
    if not files:
        raise GraphshardFileNotFoundError(
            f"No *{_SUFFIX} file in {root}: save the model with save_pretrained(path) "
            "(safe_serialization is the default), or convert its .bin files first."
        )
    return files


def _read_headers(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the files' headers (no data is read)."""
    from safetensors import safe_open

    found: dict[str, tuple[int, ...]] = {}
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key in where:
                    raise CheckpointMismatchError(
                        f"Tensor {key!r} is in both {where[key].name} and {file.name} in "
                        f"{file.parent}: a save_pretrained directory holds each tensor once."
                    )
                where[key] = file
                found[key] = tuple(f.get_slice(key).get_shape())
    return found


def _untied(module: nn.Module, missing: list[str], found: dict) -> str:
    """A hint for tied weights the config names but the model does not share: an unsharded
    model's ``to_empty`` makes each name its own tensor (a sharded one stays tied)."""
    tied = getattr(module, "all_tied_weights_keys", None) or {}
    pairs = [f"{k} -> {tied[k]}" for k in missing if tied.get(k) in found]
    if not pairs:
        return ""
    return (
        f"The config ties {', '.join(pairs)}, but the model holds separate tensors "
        "(to_empty on an unsharded model unties them): call model.tie_weights() after "
        "to_empty."
    )


def _plan(module: nn.Module, found: dict[str, tuple[int, ...]], path: Path,
          strict: bool) -> list[str]:
    """Check ``found`` (the files' names and shapes) against ``module``; return the model's
    state-dict keys to read from the files (one name per tied tensor)."""
    return plan_keys(module, found, strict=strict, what=_WHAT, hint=_hint(module, path))


def _hint(module: nn.Module, path: Path) -> Callable[[list[str], dict], str]:
    """What to do about a mismatch, given the missing keys and what the files hold."""

    def hint(missing: list[str], found: dict) -> str:
        return _untied(module, missing, found) or (
            f"{path} holds the weights of a different model (or a different config of it): "
            "build the model from the config saved with these weights "
            "(AutoConfig.from_pretrained(path)), or pass strict=False to load only the "
            "tensors both have."
        )

    return hint


def load_safetensors(
    module: nn.Module,
    path: str | os.PathLike,
    *,
    broadcast_from_rank0: bool = False,
    strict: bool = True,
    rename: Callable[[str], str] | None = None,
) -> list[str]:
    """Load a ``save_pretrained`` directory's ``*.safetensors`` into a (sharded) model.

    A collective: every rank of the default process group calls it. Each key and shape in
    the files' headers is checked against ``module.state_dict()`` before anything is
    written; then torch's calls read the values into the parameters and buffers, in place
    (cast to their dtype):

    - ``broadcast_from_rank0=False`` (default): every rank reads only its own rows,
      ``dcp.load(state_dict, storage_reader=HuggingFaceStorageReader(path))``. Every rank
      needs the files.
    - ``broadcast_from_rank0=True``: rank 0 alone reads the files
      (``safetensors.torch.load_file``, the whole model in its memory) and
      ``set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``
      sends each rank its rows. The other ranks need no access to ``path``.

    Args:
        module: the model (sharded by :func:`graphshard.shard`, or its ``torch.compile``
            wrapper; a plain module works too) with its storage allocated (after
            ``to_empty``).
        path: a directory written by ``save_pretrained`` (``model.safetensors`` or the
            shards of a large model).
        broadcast_from_rank0: rank 0 reads and broadcasts, instead of every rank reading
            its rows.
        strict: every tensor of the model (one name per tied weight) must be in the files
            and every tensor in the files must be in the model; False loads the names both
            have. Shapes must match either way.
        rename: the model's name of each tensor name in the files, for a model written
            with other names (``graphshard.models.llama.llama_name_from_hf`` loads a
            Hugging Face Llama into the shipped ``Llama``); None keeps the names.

    Returns:
        The model's state-dict keys that were loaded.

    Raises:
        CheckpointMismatchError: on every rank, naming every missing, unexpected and
            mis-shaped key; nothing was written.
        FileNotFoundError: ``path`` is no directory or holds no ``*.safetensors`` file (on
            every rank, also when only one rank cannot read it).
    """
    root = root_module(module)
    path = Path(path)
    rename = rename or (lambda name: name)
    if broadcast_from_rank0:
        return _load_from_rank0(root, path, strict, rename)
    import torch.distributed.checkpoint as dcp

    file_name: dict[str, str] = {}  # the model's name -> the files' name

    def plan() -> list[str]:
        found = {}
        for name, shape in _read_headers(safetensors_files(path)).items():
            file_name[rename(name)] = name
            found[rename(name)] = shape
        return _plan(root, found, path, strict)

    keys = agree(plan)
    state = root.state_dict()
    dcp.load({file_name[k]: state[k] for k in keys},
             storage_reader=dcp.HuggingFaceStorageReader(str(path)))  # fmt: skip
    return keys


def _load_from_rank0(root: nn.Module, path: Path, strict: bool,
                     rename: Callable[[str], str]) -> list[str]:
    from safetensors.torch import load_file

    def read() -> dict[str, torch.Tensor]:
        full: dict[str, torch.Tensor] = {}
        for file in safetensors_files(path):
            part = load_file(str(file))
            if dup := full.keys() & part.keys():
                raise CheckpointMismatchError(
                    f"Tensor(s) {sorted(dup)[:5]} appear in more than one file in {path}: "
                    "a save_pretrained directory holds each tensor once."
                )
            full.update(part)
        return {rename(name): value for name, value in full.items()}

    return broadcast_full_state(root, read, strict=strict, what=_WHAT, hint=_hint(root, path))


def init_non_persistent_buffers(model: nn.Module) -> list[str]:
    """Recompute a Hugging Face model's non-persistent buffers (the rotary ``inv_freq`` and
    ``original_inv_freq``) after ``to_empty``, as ``from_pretrained`` does.

    They are in no weights file, and ``to_empty`` leaves them uninitialised. Each module
    that owns one is passed to the ``_init_weights`` of the ``PreTrainedModel`` it belongs
    to (the innermost one), which recomputes them from the config (every RoPE type); then
    every non-persistent buffer is checked to have been written. Call it before loading the
    weights: ``_init_weights`` may also initialise the module's own parameters.

    Args:
        model: a ``transformers.PreTrainedModel`` (sharded or not, or its ``torch.compile``
            wrapper) whose storage is allocated.

    Returns:
        The names of the buffers recomputed.

    Raises:
        TypeError: ``model`` is no ``PreTrainedModel`` (no ``_init_weights``).
        RuntimeError: naming a non-persistent buffer ``_init_weights`` did not write: set
            it yourself.
    """
    root = root_module(model)
    if not callable(getattr(root, "_init_weights", None)):
        raise GraphshardTypeError(
            f"{type(root).__name__} is not a transformers PreTrainedModel (it has no "
            "_init_weights): recompute its non-persistent buffers with its own code."
        )
    owner: dict[int, nn.Module] = {}
    for sub in root.modules():  # parents before children: the innermost model wins
        if callable(getattr(sub, "_init_weights", None)):
            for inner in sub.modules():
                owner[id(inner)] = sub
    names: list[str] = []
    for mod_name, sub in root.named_modules():
        own = [b for b, buf in sub._buffers.items()
               if b in sub._non_persistent_buffers_set and buf is not None]
        if not own:
            continue
        with torch.no_grad():
            for b in own:  # a marker _init_weights must overwrite
                buf = sub._buffers[b]
                buf._is_hf_initialized = False  # transformers' init functions skip True
                if buf.is_floating_point() or buf.is_complex():
                    buf.fill_(float("nan"))
        owner[id(sub)]._init_weights(sub)
        for b in own:
            buf = sub._buffers[b]
            fqn = f"{mod_name}.{b}" if mod_name else b
            if (buf.is_floating_point() or buf.is_complex()) and torch.isnan(buf).any():
                raise GraphshardRuntimeError(
                    f"{type(owner[id(sub)]).__name__}._init_weights did not set the "
                    f"non-persistent buffer {fqn!r} of {type(sub).__name__}: compute it "
                    "yourself after to_empty (it is in no weights file)."
                )
            names.append(fqn)
    return names
