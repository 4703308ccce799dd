"""Eagerly, the reads of one parameter inside one module call share one gather
(:mod:`graphshard.api.eager_gathers`), on a fake group of 2 ranks: the collectives are
counted as they are dispatched (the numerics are checked on real ranks, in
``test_training_loops.py``). Not with torch's ``CommDebugMode``: its module tracker raises
``IndexError`` in ``_fw_set_module_hook`` on a plain two-level model whose child is called
twice (torch 2.13)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphshard
from graphshard.api.sharding import shard_state
from graphshard.errors import GraphshardRuntimeError, ShardedModelError
from graphshard.passes.markers import REDUCE_GRAD, UNSHARD

_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_REDUCE_SCATTERS = (torch.ops._c10d_functional.reduce_scatter_tensor.default,
                    torch.ops._c10d_functional.all_to_all_single.default)  # gloo's


class Reads(nn.Module):
    """Reads its weight and bias ``times`` times in one forward (a count that, in a mixture
    of experts, follows the routing)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8))
        self.b = nn.Parameter(torch.zeros(4))
        self.times = 3
        self.scale_without_grad = False
        self.update_in_place = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_without_grad:
            with torch.no_grad():
                x = x / self.w.norm()
        y = x.new_zeros(x.shape[0], 4)
        for _ in range(self.times):
            y = y + F.linear(x, self.w, self.b)
        if self.update_in_place:  # the shared copy, after the last gather: found at return
            w = self.w
            with torch.no_grad():
                w.mul_(2.0)
        return y


class Twice(nn.Module):
    """Calls ``inner`` twice, then the head."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Reads()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x) + self.inner(x)).sum()


class Collectives(TorchDispatchMode):
    """Counts the eager all-gathers (``graphshard::unshard``, one each at world 2, and a
    bucket's, ``api.bucket_gathers``) and gradient reductions (``graphshard::reduce_grad``,
    one reduce-scatter each, and a bucket's reads', ``bucket_reads.read_bucket``)
    dispatched while it is active; the collectives inside the markers run below the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.gathers = self.others = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is UNSHARD or func is _ALL_GATHER:
            self.gathers += 1
        elif func is REDUCE_GRAD or func in _REDUCE_SCATTERS:
            self.others += 1
        return func(*args, **(kwargs or {}))


def _counts(mode: Collectives) -> tuple[int, int]:
    return mode.gathers, mode.others


@pytest.mark.parametrize("times", [1, 5])
def test_a_module_call_gathers_each_parameter_once_however_often_it_reads_it(fake2, times):
    model = graphshard.shard(Twice())
    model.inner.times = times
    x = torch.randn(3, 8)
    with Collectives() as forward:
        loss = model(x)
    with Collectives() as backward:
        loss.backward()
    # one bucket: inner's first call gathers all four parameters in one collective, its
    # second call its own two again (its copies went when the first returned), the head
    # takes its copies from the first: two gathers whatever ``times`` is (14 at times=3 when
    # every read gathered, 6 when each parameter gathered alone), and one reduce-scatter for
    # each of the two (6 when each parameter reduced alone); the backward gathers nothing
    # again (the bucket saved last keeps its copies)
    assert len(shard_state(model).bucket_members) == 1
    assert _counts(forward) == (2, 0)
    assert _counts(backward) == (0, 2)
    assert all(p.grad is not None for p in model.parameters())
    assert shard_state(model).eager_gathered == {}


def test_a_call_lets_go_of_its_gathers_when_it_returns(fake2):
    """Under ``torch.no_grad()`` nothing saves a gathered parameter for backward: a call's
    copies go when it returns (the head runs while none of inner's is held)."""
    model = graphshard.shard(Twice())
    state = shard_state(model)
    held: list[set[str]] = []
    model.head.register_forward_pre_hook(
        lambda m, args: held.append({key[0] for key in state.eager_gathered}))
    with torch.no_grad():
        model(torch.randn(3, 8))
    assert held == [set()]
    assert state.eager_gathered == {} and state.eager_gathered_at == {}


def test_a_read_without_grad_does_not_serve_a_read_that_trains(fake2):
    """The weight read under ``torch.no_grad()`` first, then with grad in the same call: two
    gathers of it (the first copy has no autograd history), and it gets a gradient. (The
    first gathers the bias with it, in one collective, for its read with grad.)"""
    model = graphshard.shard(Reads())
    model.scale_without_grad = True
    with Collectives() as forward:
        loss = model(torch.randn(3, 8)).sum()
    assert _counts(forward) == (2, 0)  # w and b, then w again with grad
    loss.backward()
    assert model.w.grad is not None and model.b.grad is not None


def test_an_in_place_update_of_a_shared_copy_is_refused_when_the_call_returns(fake2):
    model = graphshard.shard(Reads())
    model.update_in_place = True
    with pytest.raises(ShardedModelError, match="In-place update on parameter 'w'"):
        model(torch.randn(3, 8))
    state = shard_state(model)
    # nothing held over: no copy, and no read for the next forward's cross-rank comparison
    assert state.eager_gathered == {} and state.eager_gathered_at == {}
    assert state.eager_reads == []
    model.update_in_place = False
    model(torch.randn(3, 8)).sum().backward()  # the model still trains after the refusal


class WithUnused(nn.Module):
    """A linear layer and a parameter its forward never reads, in one bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.unused = nn.Parameter(torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_a_bucket_is_gathered_and_reduced_in_one_collective_each(fake2):
    """The bucket (the linear's weight and bias, and a parameter never read) is gathered by
    the first read and its gradients reduced together; the parameter nobody read is
    dropped when the forward ends and gets no gradient, as in one process."""
    model = graphshard.shard(WithUnused())
    state = shard_state(model)
    assert len(state.bucket_members) == 1
    with Collectives() as forward:
        loss = model(torch.randn(3, 8)).sum()
    assert state.bucket_stash == {} and state.buckets_gathered == set()
    with Collectives() as backward:
        loss.backward()
    assert _counts(forward) == (1, 0) and _counts(backward) == (0, 1)
    assert model.lin.weight.grad is not None and model.lin.bias.grad is not None
    assert model.unused.grad is None


def test_a_shard_written_after_its_buckets_gather_is_gathered_again(fake2):
    """The head's weight is updated in place (through its DTensor) after the bucket was
    gathered and before the head reads it: the waiting copy is stale, so the head gathers
    its weight on its own (its bias still takes the bucket's copy)."""
    model = graphshard.shard(Twice())

    def scale(module: nn.Module, args: tuple) -> None:
        with torch.no_grad():
            module._parameters["weight"].mul_(2.0)

    model.head.register_forward_pre_hook(scale)
    with Collectives() as forward:
        loss = model(torch.randn(3, 8))
    loss.backward()
    assert _counts(forward)[0] == 3  # the bucket, inner's own again, the head's weight
    assert shard_state(model).bucket_stash == {}


class Remembers(Reads):
    """:class:`Reads` that keeps a weak reference to the memory of the copy of ``w`` its
    forward read (autograd saves a view of the copy, ``w.t()``, not the tensor itself)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.w.untyped_storage()._weak_ref()
        return super().forward(x)

    def copy_alive(self) -> bool:
        return not torch.UntypedStorage._expired(self.seen)


class Chain(nn.Module):
    """Two blocks, so two buckets: :class:`Remembers`, then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Remembers(), nn.Linear(4, 4)])
        self.blocks[0].times = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x))


@pytest.mark.parametrize("reshard", [True, False])
def test_an_eager_forward_that_reshards_lets_go_of_the_copies_it_saved(fake2, reshard):
    """``reshard_after_forward=True`` eagerly: the copy of the first block's ``w`` that
    autograd saved for the backward is gone when the forward returns, and the backward
    gathers that bucket again (once), then lets go of that too; the last bucket keeps its
    copies (the backward starts there). With False autograd keeps the forward's copies and
    the backward gathers nothing."""
    model = graphshard.shard(Chain(), reshard_after_forward=reshard)
    first = model.blocks[0]
    state = shard_state(model)
    assert len(state.bucket_members) == 2
    x = torch.randn(3, 8, requires_grad=True)  # so that F.linear saves its weight
    loss = model(x).sum()
    assert first.copy_alive() is not reshard
    torch.UntypedStorage._free_weak_ref(first.seen)
    with Collectives() as backward:
        loss.backward()
    assert _counts(backward) == (1 if reshard else 0, 2)
    assert all(p.grad is not None for p in model.parameters()) and x.grad is not None
    del loss
    assert state.resharded_live == {} and state.regathered == {}


def test_hooks_around_the_forward_still_see_the_other_saved_tensors(fake2):
    """A user's saved-tensor hooks around the forward (``save_on_cpu`` and the like) keep
    packing what autograd saves besides the gathered copies, and unpack it in the backward."""
    model = graphshard.shard(Reads())
    packed, unpacked = [], []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.shape)
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(t.shape)
        return t

    x = torch.randn(3, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = model(x).sum()
    assert (3, 8) in packed  # the input, saved by F.linear for w's gradient
    assert (4, 8) not in packed  # w's copy: graphshard's handle, not the user's
    loss.backward()
    assert sorted(unpacked) == sorted(packed)
    assert x.grad is not None and model.w.grad is not None


def test_a_parameter_updated_between_forward_and_backward_is_refused(fake2):
    """With the forward's copies let go, the backward would gather the updated values and
    compute gradients of a model that never ran; one process's autograd refuses the same."""
    model = graphshard.shard(Reads())
    loss = model(torch.randn(3, 8, requires_grad=True)).sum()
    with torch.no_grad():
        model.w.mul_(0.5)  # through the DTensor, as torch's optimizers step
    with pytest.raises(GraphshardRuntimeError, match="'w', which the backward needs, was "
                                                     "modified in place since the forward"):
        loss.backward()


class Issued(TorchDispatchMode):
    """Logs, into ``log``, each bucket's all-gather as it is issued (``G``), each wait for a
    collective (``w``) and each parameter's own gather (``U``, whose collective runs below
    the mode); hooks log each block's forward (``f0``) and backward (``b0``)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _ALL_GATHER:
            self.log.append("G")
        elif func is UNSHARD:
            self.log.append("U")
        elif func is torch.ops._c10d_functional.wait_tensor.default:
            self.log.append("w")
        return func(*args, **(kwargs or {}))


class Blocks(nn.Module):
    """Four linear blocks (four buckets of two parameters); ``skip`` leaves block 1 out."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if not (self.skip and i == 1):
                x = block(x)
        return x


def _blocks_logged(reshard: bool, log: list[str]) -> nn.Module:
    """:class:`Blocks`, sharded, each block's calls logged."""
    model = graphshard.shard(Blocks(), reshard_after_forward=reshard)
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, args, i=i: log.append(f"f{i}"))
        block.register_full_backward_pre_hook(lambda m, grads, i=i: log.append(f"b{i}"))
    return model


def _step_logged(model: nn.Module, log: list[str]) -> tuple[str, str]:
    log.clear()
    with Issued(log):
        loss = model(torch.randn(3, 8, requires_grad=True)).sum()
        log.append("|")
        loss.backward()
    forward, backward = " ".join(log).split(" | ")
    return forward, " ".join(e for e in backward.split() if e != "w")


def test_each_buckets_gather_is_issued_one_bucket_ahead(fake2):
    """The first forward learns the order of the buckets; from the second on, a bucket's
    gather is issued before the previous bucket computes (``f0 G G w``: block 0's gather,
    block 1's, then the wait for block 0's), so it runs under that compute. The backward of
    ``reshard_after_forward=True`` issues the gather of the bucket it needs next with the
    one it needs now (the last bucket kept its copies). The gathers are as many as without
    (four and three)."""
    log: list[str] = []
    model = _blocks_logged(True, log)
    state = shard_state(model)
    first, backward = _step_logged(model, log)
    assert first == "f0 G w f1 G w f2 G w f3 G w"  # nothing known yet: each at its read
    assert backward == "b3 b2 G G b1 G b0"  # block 2's, then block 1's ahead; block 0's ahead
    for _ in range(2):
        forward, backward = _step_logged(model, log)
        assert forward == "f0 G G w f1 G w f2 G w f3 w"
        assert backward == "b3 b2 G G b1 G b0"
    assert state.bucket_prefetched == {} and state.regather_pending == {}
    assert all(p.grad is not None for p in model.parameters())


def test_a_backward_that_raises_leaves_nothing_gathered_again_for_later(fake2):
    """A backward that raises part-way (a hook refusing a non-finite gradient) never reaches
    its end, where what it gathered again and the gather it issued ahead go. The next
    forward lets them go (before: the gather issued ahead stayed, never waited for, and
    no later backward cleared what it gathered again), and the steps after run as usual."""
    log: list[str] = []
    model = _blocks_logged(True, log)
    state = shard_state(model)
    _step_logged(model, log)

    def refuse(module: nn.Module, grads: tuple) -> None:
        raise FloatingPointError("a non-finite gradient")

    handle = model.blocks[1].register_full_backward_pre_hook(refuse)
    with pytest.raises(FloatingPointError):
        model(torch.randn(3, 8, requires_grad=True)).sum().backward()
    handle.remove()
    assert state.regather_pending and state.regathered_clear_queued  # block 0's, ahead
    for first in ("w ", ""):  # the first forward waits for that gather and drops it
        forward, backward = _step_logged(model, log)
        assert forward == first + "f0 G G w f1 G w f2 G w f3 w"
        assert backward == "b3 b2 G G b1 G b0"
        assert state.regather_pending == {} and not state.regathered_clear_queued
        assert state.regathered == {}


def test_a_forward_in_another_order_drops_what_it_did_not_read(fake2):
    """A forward that skips the bucket issued ahead (a data-dependent path) waits for it and
    drops it at its end; the next complete forward sets the order anew."""
    log: list[str] = []
    model = _blocks_logged(False, log)
    state = shard_state(model)
    _step_logged(model, log)
    model.skip = True  # block 1, whose gather block 0 issues, is not read
    log.clear()
    with Issued(log), torch.no_grad():
        model(torch.randn(3, 8))
    # block 0 issues block 1's, block 2 block 3's; block 1's is waited for at the end
    assert " ".join(log) == "f0 G G w f2 G G w f3 w w"
    assert state.bucket_prefetched == {}
    log.clear()
    with Issued(log), torch.no_grad():
        model(torch.randn(3, 8))
    assert " ".join(log) == "f0 G G w f2 G w f3 w"  # block 2's ahead of block 0's compute


def test_a_shard_written_after_its_gather_was_issued_ahead_is_gathered_again(fake2):
    """Block 0 scales block 1's weight in place after block 1's gather was issued ahead: the
    copy on its way is stale, so block 1 gathers that weight on its own (its bias still
    takes the bucket's copy)."""
    log: list[str] = []
    model = _blocks_logged(False, log)
    _step_logged(model, log)

    def scale(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        with torch.no_grad():
            model.blocks[1]._parameters["weight"].mul_(2.0)

    model.blocks[0].register_forward_hook(scale)
    forward, _ = _step_logged(model, log)
    assert forward == "f0 G G w f1 G w U f2 G w f3 w"  # block 1's weight again, alone


def test_a_gather_issued_ahead_is_read_once(fake2):
    """A pending bucket gather hands its copies out once; a second read is refused with
    graphshard's error rather than waiting on a collective that is gone."""
    from graphshard.api.bucket_gathers import issue_gather

    model = graphshard.shard(Blocks())
    model(torch.randn(3, 8)).sum().backward()
    state = shard_state(model)
    bucket, reads = next((b, list(m)) for b, m in state.bucket_members.items() if m)
    pending = issue_gather(reads)
    fulls = pending.copies()
    assert [f.shape for f in fulls] == [e.param.shape for e, _ in reads], bucket
    with pytest.raises(GraphshardRuntimeError, match="read after it was waited for"):
        pending.copies()
    pending.drop()  # dropping one already waited for is fine


class Reductions(TorchDispatchMode):
    """Logs, into ``log``, each reduce-scatter of a bucket's gradients as it is issued
    (``R0``, ``R1``, ... in the order issued) and the wait that finishes it (``r0``, ...);
    the blocks' hooks log their backward (``b0``)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self.issued: dict[int, int] = {}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _REDUCE_SCATTERS:
            self.issued[id(out)] = self.count
            self.log.append(f"R{self.count}")
            self.count += 1
        elif func is torch.ops._c10d_functional.wait_tensor.default and id(args[0]) in self.issued:
            self.log.append(f"r{self.issued.pop(id(args[0]))}")
        return out


@pytest.mark.parametrize("reshard", [True, False])
def test_each_buckets_reduction_is_finished_under_the_next_buckets_backward(fake2, reshard):
    """From the second step on (the first learns the order of the buckets), a bucket's
    reduce-scatter is waited for in the backward of the bucket read before it, after that
    bucket's compute and the issue of its own reduction: ``R0`` runs under block 2's
    backward. The first bucket, which nothing precedes, waits for its own. The first step
    waits for each where it is issued."""
    log: list[str] = []
    model = _blocks_logged(reshard, log)
    hooked: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: hooked.append(name))
    for step in range(3):
        log.clear()
        hooked.clear()
        loss = model(torch.randn(3, 8, requires_grad=True)).sum()
        with Reductions(log):
            loss.backward()
        backward = " ".join(e for e in log if e[0] in "bRr")
        if step == 0:
            assert backward == "b3 R0 r0 b2 R1 r1 b1 R2 r2 b0 R3 r3"
        else:
            assert backward == "b3 R0 b2 R1 r0 b1 R2 r1 b0 R3 r2 r3"
        assert sorted(hooked) == sorted(n for n, _ in model.named_parameters())
        assert shard_state(model).bucket_relay is None
        for p in model.parameters():
            p.grad = None


def test_a_bucket_whose_copies_get_no_gradient_still_finishes_the_next_ones(fake2):
    """Block 0's output is left out of the loss, so no gradient reaches its copies; its
    backward still runs (the relay's token), and block 1's gradients arrive."""
    model = graphshard.shard(Blocks())

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        model.blocks[0](x)  # read, then unused
        h = x
        for block in model.blocks[1:]:
            h = block(h)
        return h.sum()

    for _ in range(2):  # the first forward learns the order; the second relays
        loss_of(torch.randn(3, 8)).backward()
        assert [p.grad is None for p in model.blocks[0].parameters()] == [True, True]
        assert all(p.grad is not None for b in model.blocks[1:] for p in b.parameters())
        for p in model.parameters():
            p.grad = None
