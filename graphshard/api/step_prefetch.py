"""The optimizer step gathers the buckets the next forward starts with (``Plan.step_prefetch``).

The compiled forward's leading all-gathers are ``graphshard::take_prefetched`` nodes
(:mod:`graphshard.passes.step_prefetch`). Their kernel, here, records each one's recipe (the
model, its parameters, piece sizes and dtype) and the graph they lead. A global optimizer
step hook then, at the next ``optimizer.step()`` of an optimizer holding every trainable
parameter of such a bucket:

1. updates those parameters first. Only for the optimizers of :data:`PER_PARAMETER` (whose
   update of a parameter reads nothing but that parameter, its gradient and its own state,
   so updating them in two parts is bit-identical to one), and only for a ``step()`` without
   a closure: its step function runs once, on a view of the optimizer whose parameter groups
   list those parameters first, then the rest;
2. issues the all-gather of their updated shards (async), which runs while the optimizer
   updates the other parameters, then while ``zero_grad``, the data loader and the next
   forward's start run. Other optimizers are left alone and the gathers are issued after
   their ``step()`` returns.

The next forward's ``take_prefetched`` compares its input with what this rank sent, bit for
bit, and the ranks agree (one all-reduce of flags per graph) before any takes a buffer: if
any rank's shards changed in between (a parameter edited in place, loaded, re-assigned)
every rank gathers again. A forward with nothing prefetched (the first one, a second
forward without a step, a micro-batch under ``no_sync``) gathers as the all-gather it
replaces. So results are the same, bit for bit, as without the feature.

Every rank must call ``optimizer.step()`` the same number of times (as for any collective):
each call may issue a gather.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from graphshard.api.local_inputs import same_view
from graphshard.errors import GraphshardRuntimeError
from graphshard.passes.markers import PREFETCH_BY_BREAK, PREFETCH_BY_STEP
from graphshard.records import ShardedParam, ShardState
from graphshard.safety.gloo_gather import all_gather, all_gather_single

__all__ = ["PER_PARAMETER", "track", "stats", "reset_stats", "pending", "wait_issued",
           "issue_lead", "versioned_pending", "drop_versioned"]

_c10d = torch.ops._c10d_functional

# Optimizers whose update of a parameter reads only that parameter, its gradient, its own
# state and the group's hyper-parameters: updating a subset first, then the rest, gives the
# same bits as one step (checked in tests/test_step_edges.py, foreach and fused included).
# Exact types: a subclass may override ``step``.
PER_PARAMETER: frozenset[type[torch.optim.Optimizer]] = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop,
    torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop,
})

_STATS: Counter[str] = Counter()

def stats() -> dict[str, int]:
    """Counts since the last :func:`reset_stats`: ``issued`` (gathers the step issued),
    ``taken`` (forward gathers that used one), ``stale`` (one was there but some rank's
    shards had changed: gathered again), ``fresh`` (nothing prefetched: gathered),
    ``split_steps`` (optimizer steps that updated the prefetched parameters first)."""
    return {k: _STATS[k] for k in ("issued", "taken", "stale", "fresh", "split_steps")}


def reset_stats() -> None:
    """Zero the counts of :func:`stats`."""
    _STATS.clear()


# --------------------------------------------------------------------------- records


@dataclass
class _Recipe:
    """How to rebuild one bound gather's input from its model's shards."""

    state: weakref.ref[ShardState]
    indices: list[int]  # ShardedParam positions in state.params, in buffer order
    piece_numels: list[int]
    dtype: torch.dtype
    group_size: int
    group_name: str
    lead: str  # the graph's leading gathers, named together

    def entries(self) -> list[ShardedParam] | None:
        state = self.state()
        return None if state is None else [state.params[i] for i in self.indices]


@dataclass
class _Slot:
    """A gather the step issued: what this rank sent, the gathered buffer and the pending
    work; ``verdict``, once the ranks agreed whether it is still exact."""

    sent: torch.Tensor
    gathered: torch.Tensor
    work: Any
    verdict: bool | None = None
    # issued at the end of a forward graph (graphshard.api.break_prefetch): what tells
    # that a shard it was built from changed since, per shard; None: issued by a step
    versions: list[tuple[int, int]] | None = None


_STATES: dict[int, weakref.ref[ShardState]] = {}
# (storage, offset, shape) of a local shard -> (id(state), index)
_LOCALS: dict[tuple[int, int, tuple[int, ...]], tuple[int, int]] = {}
_RECIPES: dict[tuple[int, str], _Recipe] = {}  # (id(state), key), in first-use order
_SLOTS: dict[tuple[int, str], _Slot] = {}
_LEAD: dict[int, str] = {}  # id(state) -> the lead of the first forward after a step
_AFTER_STEP: set[int] = set()  # id(state) of models whose next forward sets _LEAD
_ORPHANS: list[_Slot] = []  # gathers of collected models, waited at the next safe point
_SETTLED: dict[str, _Slot] = {}  # key -> slot settled by its graph's first leading gather
# (id(state), lead) of the last graph whose leading gathers may come from the forward graph
# before it (PREFETCH_BY_BREAK): read and reset by graphshard.api.break_prefetch around
# each forward graph it runs
last_break_lead: tuple[int, str] | None = None


def track(state: ShardState) -> None:
    """Make a sharded model's parameters known to the forward's ``take_prefetched``."""
    sid = id(state)
    _STATES[sid] = weakref.ref(state, lambda _: _forget(sid))
    _AFTER_STEP.add(sid)


def _forget(sid: int) -> None:
    """A sharded model was garbage-collected (a weakref callback: it may run anywhere, even
    while Dynamo traces, so its pending gathers are only set aside, and waited at the next
    step or forward)."""
    _STATES.pop(sid, None)
    _LEAD.pop(sid, None)
    _AFTER_STEP.discard(sid)
    for key in [k for k in _RECIPES if k[0] == sid]:
        del _RECIPES[key]
    for key in [k for k in _SLOTS if k[0] == sid]:
        _ORPHANS.append(_SLOTS.pop(key))


def _drain_orphans() -> None:
    while _ORPHANS:
        _drain(_ORPHANS.pop())


def pending() -> int:
    """Gathers issued by a step and not yet taken by a forward."""
    return len(_SLOTS)


def wait_issued() -> None:
    """Block until every gather the steps issued has arrived (they stay to be taken).

    For timing: a benchmark that runs other work between a step and the next forward calls
    it at the end of the step, so the gathers are not hidden under work a training loop
    would not have there."""
    for slot in list(_SLOTS.values()):  # a collected model's _forget may pop meanwhile
        slot.work.wait()


def _where(tensor: torch.Tensor) -> tuple[int, int, tuple[int, ...]]:
    """A tensor's storage (its C++ object), offset in it and shape: the same for an alias
    made by ``detach()``, which is a different Python object."""
    return tensor.untyped_storage()._cdata, tensor.storage_offset(), tuple(tensor.shape)


def _locate(shard: torch.Tensor) -> tuple[ShardState, int] | None:
    """The model and parameter whose local shard ``shard`` is. The compiled forward gets
    each trainable parameter's plain tensor (``ShardedParam.local``) or a frozen one's local
    tensor, or an alias of either over the same storage: AOTAutograd detaches an input whose
    gradient the graph never needs (the parameters under ``no_sync``), so an object's
    identity does not say which parameter it is; its storage, offset and layout do (all of
    them view the local shard: ``entry.local`` is made over its storage)."""
    where = _where(shard)
    for attempt in range(2):
        hit = _LOCALS.get(where)
        if hit is not None:
            ref = _STATES.get(hit[0])
            state = None if ref is None else ref()
            if state is not None and hit[1] < len(state.params):
                local = getattr(state.params[hit[1]].param, "_local_tensor", None)
                if local is not None and same_view(shard, local):
                    return state, hit[1]
        if attempt == 0:
            _LOCALS.clear()
            for sid, ref in list(_STATES.items()):
                state = ref()
                for index, entry in enumerate(() if state is None else state.params):
                    local = getattr(entry.param, "_local_tensor", None)
                    if local is not None:
                        _LOCALS[_where(local)] = (sid, index)
    return None


# --------------------------------------------------------------------------- the forward


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    size = a.element_size()
    if size not in ints or a.is_complex():
        return torch.equal(a, b)
    return torch.equal(a.view(ints[size]), b.view(ints[size]))


def _everyone(oks: list[bool], group_name: str, device: torch.device) -> list[bool]:
    """For each entry of ``oks``: whether it holds on every rank of the group (one
    all-reduce)."""
    flags = torch.tensor([1 if ok else 0 for ok in oks], dtype=torch.int32, device=device)
    return [bool(v) for v in _c10d.wait_tensor(_c10d.all_reduce(flags, "min", group_name))]


def _gather(flat: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """The all-gather ``take_prefetched`` stands for, of a private copy of ``flat``: it is
    still in flight when the kernel returns (the graph's ``wait_tensor`` completes it), and
    the compiler does not know that it reads ``flat`` until then. Inductor keeps a
    collective's input alive up to its wait only for its own collective kernels; to it this
    is an opaque op after which ``flat`` is dead, so it may write the next buffer into
    ``flat``'s storage before the wait (torch 2.14.1 does: the layers' bucket input is
    reused for the next bucket's input), and the gather would send that instead."""
    return all_gather(flat.clone(), group_size, group_name)


def _drain(slot: _Slot) -> None:
    slot.work.wait()


def _find_slot(sid: int | None, key: str) -> _Slot | None:
    """Take this model's slot of this gather. Without a located model, none: a slot of the
    same key may be another model's (one not yet collected on some ranks only), and every
    rank must decide alike whether it takes one, since taking one is a collective."""
    return None if sid is None else _SLOTS.pop((sid, key), None)


def _take_prefetched(flat: torch.Tensor, group_size: int, group_name: str, *,
                     shards: list[torch.Tensor], piece_numels: list[int], key: str,
                     lead: str, peers: list[torch.Tensor],
                     peer_keys: list[str], sources: int = PREFETCH_BY_STEP) -> torch.Tensor:
    """The all-gather of ``flat``: the buffer the optimizer step gathered if every rank's
    ``flat`` equals what it sent, else a new gather (completed by the graph's wait). The
    first of a graph's leading gathers settles its ``peers`` too, in the same all-reduce.
    A buffer the previous forward graph gathered (``sources`` with ``PREFETCH_BY_BREAK``) is
    taken if this rank's shards are unchanged since, by their version counters."""
    global last_break_lead
    _install_hooks()
    _drain_orphans()
    located = [_locate(shard) for shard in shards]
    sid = None
    if all(hit is not None for hit in located) and len({id(s) for s, _ in located}) == 1:
        state = located[0][0]
        sid = id(state)
        _RECIPES[(sid, key)] = _Recipe(
            weakref.ref(state), [index for _, index in located], list(piece_numels),
            flat.dtype, group_size, group_name, lead,
        )  # fmt: skip
        if sid in _AFTER_STEP and sources & PREFETCH_BY_STEP:
            _AFTER_STEP.discard(sid)  # the first forward since a step: its lead is what to
            _LEAD[sid] = lead  # prefetch
        if sources & PREFETCH_BY_BREAK and last_break_lead is None:
            last_break_lead = (sid, lead)
    slot = _SETTLED.pop(key, None)  # settled by this graph's first leading gather
    if slot is None:
        _drop_settled()  # what a graph that stopped early left settled held only for it
        slot = _find_slot(sid, key)
    if slot is None:  # nothing prefetched, on every rank (the same steps issued the same)
        _STATS["fresh"] += 1
        return _gather(flat, group_size, group_name)
    if slot.verdict is None and slot.versions is not None:  # the previous graph's gather
        slot.verdict = _unchanged(slot, located)
    if slot.verdict is None:  # settle it, and this graph's other leading gathers with it
        others = [_find_slot(sid, k) for k in peer_keys]
        oks = [_same_bits(slot.sent, flat)] + [
            other is not None and _same_bits(other.sent, peer)
            for other, peer in zip(others, peers, strict=True)
        ]
        slot.verdict, *verdicts = _everyone(oks, group_name, flat.device)
        for k, other, verdict in zip(peer_keys, others, verdicts, strict=True):
            if other is not None:
                other.verdict = verdict
                _SETTLED[k] = other
    if slot.verdict:
        _STATS["taken"] += 1
        slot.work.wait()  # the graph's wait_tensor has nothing left to wait for
        return slot.gathered
    _drain(slot)
    _STATS["stale"] += 1
    return _gather(flat, group_size, group_name)


def _unchanged(slot: _Slot, located: list[tuple[ShardState, int] | None]) -> bool:
    """Whether the shards a gather issued at the end of the previous forward graph was built
    from are unchanged since. Between two graphs of one forward nothing updates a shard
    (graphshard refuses an update of a parameter there), and between two forwards with no
    backward or optimizer step between, nothing normally does: a change there is raised on
    that rank rather than taking stale values or gathering alone."""
    now = [_version_of(state.params[index]) for state, index in located]
    if now == slot.versions:
        return True
    _drain(slot)
    changed = next(state.params[index].names[0]
                   for (state, index), was, is_ in zip(located, slot.versions, now, strict=True)
                   if was != is_)
    raise GraphshardRuntimeError(
        f"graphshard: the local shard of parameter {changed!r} changed after "
        f"graphshard.backend(break_prefetch=True) gathered it at the end of the forward graph "
        f"before (across a graph break, or at the end of the previous forward, with no "
        f"backward or optimizer step since). The ranks must agree on the shards there, and "
        f"no collective checks it. Update parameters after a backward or in an optimizer "
        f"step, or turn break_prefetch off.")


def _version_of(entry: ShardedParam) -> tuple[int, int]:
    """What tells that ``entry``'s local shard changed: its object and version counter."""
    local = entry.param._local_tensor
    return id(local), local._version


def _drop_settled() -> None:
    """Forget verdicts a graph did not use: they held only for its inputs."""
    for slot in _SETTLED.values():
        _drain(slot)
    _SETTLED.clear()


torch.library.register_kernel("graphshard::take_prefetched", None, _take_prefetched)


# --------------------------------------------------------------------------- the step


def _issue(recipes: list[tuple[tuple[int, str], _Recipe]], *, versioned: bool = False
           ) -> None:
    """All-gather each recipe's input, rebuilt from the shards as they are now
    (``versioned``: for the next forward graph, recording the shards' versions)."""
    _drain_orphans()
    _drop_settled()
    for key, recipe in recipes:
        entries = recipe.entries()
        if entries is None:
            continue
        pieces = []
        for entry, numel in zip(entries, recipe.piece_numels, strict=True):
            piece = entry.param._local_tensor.detach().to(recipe.dtype).reshape(-1)
            if piece.numel() != numel:
                piece = torch.nn.functional.pad(piece, (0, numel - piece.numel()))
            pieces.append(piece)
        sent = torch.cat(pieces)  # a new tensor: later writes to the shards cannot reach it
        old = _SLOTS.pop(key, None)
        if old is not None:
            _drain(old)
        gathered = sent.new_empty(recipe.group_size * sent.numel())
        work = all_gather_single(gathered, sent, _resolve_process_group(
            recipe.group_name), async_op=True)
        versions = [_version_of(entry) for entry in entries] if versioned else None
        _SLOTS[key] = _Slot(sent, gathered, work, versions=versions)
        _STATS["issued"] += 1


def issue_lead(sid: int, lead: str) -> None:
    """Issue the leading gathers ``lead`` names of model ``id(state) == sid``, recording
    the shards' versions (:mod:`graphshard.api.break_prefetch`: for the next forward
    graph, which takes them while the versions hold)."""
    due = [(key, recipe) for key, recipe in _RECIPES.items()
           if key[0] == sid and recipe.lead == lead]
    if due:
        _issue(due, versioned=True)


def versioned_pending() -> int:
    """Gathers :func:`issue_lead` issued that no graph has taken yet."""
    return sum(1 for slot in _SLOTS.values() if slot.versions is not None)


def drop_versioned() -> None:
    """Drop the gathers :func:`issue_lead` issued that no graph took (each waited for)."""
    for key in [k for k, slot in _SLOTS.items() if slot.versions is not None]:
        _drain(_SLOTS.pop(key))


def _due(optimizer: torch.optim.Optimizer) -> list[tuple[tuple[int, str], _Recipe]]:
    """The recipes to issue at this step: the lead of each model's last forward, when this
    optimizer holds every trainable parameter of it."""
    if not _RECIPES:
        return []
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    due = []
    for key, recipe in list(_RECIPES.items()):
        entries = recipe.entries()
        if entries is None:
            del _RECIPES[key]
            continue
        if _LEAD.get(key[0]) != recipe.lead:
            continue
        trainable = [e.param for e in entries if e.param.requires_grad]
        if trainable and all(id(p) in held for p in trainable):
            due.append((key, recipe))
    return due


class _SplitGroups(list):
    """An optimizer's parameter groups as its step iterates them: each group's prefetched
    parameters first, then ``between()``, then each group's other parameters. The groups
    are read when the step iterates (after every pre-hook ran: an lr a hook set is used)."""

    def __init__(self, groups: list[dict[str, Any]], first: set[int],
                 between: Callable[[], None]) -> None:
        self._groups, self._first, self._between = groups, first, between
        super().__init__(self._split(True) + self._split(False))

    def _split(self, front: bool) -> list[dict[str, Any]]:
        parts = [{**g, "params": [p for p in g["params"] if (id(p) in self._first) == front]}
                 for g in self._groups]
        return [g for g in parts if g["params"]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        yield from self._split(True)
        self._between()
        yield from self._split(False)


class _SplitView:
    """The optimizer its own step function runs on, with :class:`_SplitGroups` for
    ``param_groups``; every other attribute is the optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: _SplitGroups) -> None:
        object.__setattr__(self, "_optimizer", optimizer)
        object.__setattr__(self, "param_groups", groups)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._optimizer, name, value)


_PENDING_ATTR = "_graphshard_step_prefetch"  # on the optimizer: what its post-hook issues


def _pre_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> Any:
    if torch.compiler.is_compiling():
        return None
    due = _due(optimizer)
    if not due:
        return None
    done: list[bool] = []

    def issue() -> None:
        if not done:
            done.append(True)
            _issue(due)

    optimizer.__dict__[_PENDING_ATTR] = issue  # the post-hook issues them if not yet done
    closure = any(a is not None for a in args[1:]) or kwargs.get("closure") is not None
    if type(optimizer) not in PER_PARAMETER or closure:
        return None  # left alone: gathered after its step
    first = {id(e.param) for _, recipe in due for e in recipe.entries() or ()}
    view = _SplitView(optimizer, _SplitGroups(optimizer.param_groups, first, issue))
    _STATS["split_steps"] += 1
    return (view, *args[1:]), kwargs


def _post_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_compiling():
        return
    issue = optimizer.__dict__.pop(_PENDING_ATTR, None)
    if issue is not None:
        issue()
    _AFTER_STEP.update(_STATES)


_HOOKS: list[Any] = []  # the global optimizer step hooks, once a forward has bound a gather


def _install_hooks() -> None:
    """Register the global optimizer step hooks, the first time a ``take_prefetched`` kernel
    runs: a process that never turns ``step_prefetch`` on never has them on its steps."""
    if not _HOOKS:
        _HOOKS.extend((register_optimizer_step_pre_hook(_pre_step),
                       register_optimizer_step_post_hook(_post_step)))
