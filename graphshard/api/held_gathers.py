"""``graphshard.unshard(model)``: gather every parameter once and keep it, for generation.

Eagerly each module call gathers the parameters it reads and lets them go when it returns
(:mod:`graphshard.api.eager_gathers`), which is what training wants. A generation loop (an
RL rollout, ``model.generate()`` in an evaluation) calls the whole model once per new token
without gradients, so it would gather every parameter again at every token. FSDP2 answers
this with ``model.unshard()`` / ``model.reshard()``; graphshard's counterpart is
:func:`unshard`: it gathers the parameters under a module once, and until :meth:`Unsharded.
reshard` (or the end of its ``with`` block) a read that records no gradient (under
``torch.no_grad()`` or ``torch.inference_mode()``) is served the held copy
(:func:`graphshard.api.eager_gathers.served_copy`). A read that trains gathers as always: a
held copy has no autograd history.

- A held copy whose parameter was updated in place since it was gathered (an optimizer step
  over the model, a ``load_state_dict`` inside the block) is gathered again at its next
  read, so a forward never reads stale values (:class:`graphshard.api.eager_gathers.
  HeldCopy` says what counts as an update). Every rank updates its shards alike, so every
  rank gathers again at the same read.
- On release, a held copy written in place is refused, as an eager gather's is when its call
  returns: the write would be lost with the copy.
- Compiled calls gather inside their graphs as always: the held copies serve eager code.
"""

from __future__ import annotations

from types import TracebackType

import torch
from torch import nn

from graphshard.api.bucket_gathers import end_forward, gather_bucket
from graphshard.api.eager_gathers import HeldCopy
from graphshard.api.param_reads import gathered_param
from graphshard.errors import GraphshardRuntimeError
from graphshard.records import ShardedParam, ShardState
from graphshard.safety.mutation import check_unchanged

__all__ = ["Unsharded", "unshard"]


class Unsharded:
    """What :func:`unshard` returns: a context manager whose exit (or :meth:`reshard`)
    lets go of the copies it gathered."""

    def __init__(self, held: list[tuple[ShardState, str]]) -> None:
        self._held = held

    @property
    def parameter_names(self) -> list[str]:
        """The names of the parameters this call gathered and holds (one name per tied
        parameter)."""
        return [name for _, name in self._held]

    def reshard(self) -> None:
        """Let go of the held copies (idempotent), raising if one was updated in place."""
        self._release(check=True)

    def _release(self, check: bool) -> None:
        """Let go of every held copy first, then (``check``) raise if one was written."""
        held, self._held = self._held, []
        released = [(name, state.held_gathered.pop(name, None)) for state, name in held]
        for name, copy in released:
            if check and copy is not None:
                check_unchanged(copy.full, copy.full_version, name)

    def __enter__(self) -> Unsharded:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._release(check=exc_type is None)  # an error unwinding: check nothing


def unshard(module: nn.Module) -> Unsharded:
    """Gather every sharded parameter under ``module`` (a model passed to
    :func:`graphshard.shard`, or a submodule of one) and hold the gathered copies: until the
    returned object's :meth:`~Unsharded.reshard`, or the end of its ``with`` block, eager
    reads that record no gradient use them instead of gathering.

    Every rank must call it alike (it gathers), outside ``torch.compile``. Use it around
    generation::

        with torch.no_grad(), graphshard.unshard(model):
            tokens = model.generate(prompt, max_new_tokens=256)

    The copies take the memory of the unsharded parameters (in the compute dtype of the
    model's ``MixedPrecision``). Parameters an enclosing :func:`unshard` already holds are
    left to it."""
    if torch.compiler.is_compiling():
        raise GraphshardRuntimeError(
            "graphshard.unshard() gathers eagerly and cannot be traced: call it outside the "
            "function torch.compile compiles (compiled calls gather inside their graphs).")
    reads = [(submodule, pname, entry, submodule.__dict__["_graphshard_root_state"])
             for submodule in module.modules()
             for pname, (entry, _) in submodule.__dict__.get("_graphshard_specs", {}).items()]
    if not reads:
        raise GraphshardRuntimeError(
            f"graphshard.unshard() was given a {type(module).__name__} that holds no sharded "
            "parameter: pass a model after graphshard.shard(model), or a submodule of it.")
    unsharded = Unsharded([])
    try:
        with torch.no_grad(), torch.inference_mode(False):
            _gather_buckets([(entry, state) for _, _, entry, state in reads])
            for submodule, pname, entry, state in reads:
                name = entry.names[0]
                if name not in state.held_gathered:
                    full = gathered_param(submodule, pname, state)
                    state.held_gathered[name] = HeldCopy(full, submodule._parameters[pname],
                                                        state.optimizer_steps)
                    unsharded._held.append((state, name))
    except BaseException:  # a parameter that cannot be gathered (on the meta device): hold none
        unsharded._release(check=False)
        raise
    finally:
        for state in {id(state): state for *_, state in reads}.values():
            if state.forward_depth == 0:
                end_forward(state)  # copies of parameters an enclosing hold had
    return unsharded


def _gather_buckets(reads: list[tuple[ShardedParam, ShardState]]) -> None:
    """Gather the parameters to hold one bucket at a time (``api.bucket_gathers``), each
    bucket's in one collective; those an enclosing hold has are left out."""
    wanted: dict[tuple[int, int], tuple[ShardedParam, ShardState, set[int]]] = {}
    for entry, state in reads:
        if entry.names[0] in state.held_gathered:
            continue
        first = wanted.setdefault((id(state), entry.bucket), (entry, state, set()))
        first[2].add(id(entry))
    for entry, state, ids in wanted.values():
        gather_bucket(state, entry, ids)
