"""``param.data = tensor`` on a sharded parameter, refused at the next eager forward or
optimizer step.

A sharded parameter is a DTensor, a wrapper whose values live in its local shard. Assigning
``.data`` swaps the wrapper's own (empty) storage and metadata but not the local shard, so
the model, the optimizer and every state dict go on reading the old values, with no error:
a weight loaded or rescaled that way is silently not there (torch's DTensor, and FSDP2's
parameters, ignore it the same way; an assigned plain tensor also leaves the wrapper with a
dtype its shard does not have). The one visible trace is the wrapper's storage, whose id
changes. Each record keeps the id its parameter had when sharded (and after every swap
graphshard follows: ``.to()``, ``to_empty()``, an accepted replacement), and the eager
forward (the model's parameters) and ``optimizer.step()`` (the ones that optimizer holds: a
per-parameter optimizer stepped from a gradient hook checks one) compare them: two ``map``
calls over the parameters.
A compiled forward does not check (its inputs are the local shards themselves); the next
optimizer step does.
"""

from __future__ import annotations

from operator import attrgetter

import torch

from graphshard.errors import ShardedModelError
from graphshard.records import ShardedParam

__all__ = ["record_wrapper", "refuse_data_assignments"]

_storage_id = torch._C._storage_id
_PARAM = attrgetter("param")
_RECORDED = attrgetter("wrapper_id")


def record_wrapper(entry: ShardedParam) -> None:
    """Remember ``entry``'s parameter as it is now: at ``shard()``, and whenever graphshard
    gives it new storage."""
    entry.wrapper_id = _storage_id(entry.param)


def refuse_data_assignments(params: list[ShardedParam]) -> None:
    """Raise if a parameter these records hold (a model's, or an optimizer's share of them)
    was given new data by assignment (``param.data = ...``) since it was sharded. Not while
    Dynamo traces."""
    if torch.compiler.is_compiling():
        return
    if list(map(_storage_id, map(_PARAM, params))) == list(map(_RECORDED, params)):
        return
    changed = [e for e in params if _storage_id(e.param) != e.wrapper_id]
    name = changed[0].names[0]
    more = f" ({len(changed)} parameters in all)" if len(changed) > 1 else ""
    raise ShardedModelError(
        f"Parameter {name!r} of a sharded model was assigned new data (param.data = ...) "
        f"after graphshard.shard(){more}. "
        "A sharded parameter is a DTensor whose values live in its local shard, which such "
        "an assignment does not reach: the model would go on reading and training the old "
        "values, with no error. Update the parameter in place under torch.no_grad() "
        "(param.copy_(new_dtensor), param.mul_(0.5)), or load full values with "
        "torch.distributed.checkpoint.state_dict.set_model_state_dict(model, "
        f"{{{name!r}: full_tensor}}, options=StateDictOptions(full_state_dict=True, "
        "strict=False)); to cast, use model.to(dtype). The assigned parameter is left broken: "
        "build and shard the model again."
    )
