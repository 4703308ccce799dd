"""A one-process "world" of N ranks whose collectives move real data (``--fake-world N``).

The process is rank ``r`` of ``N`` and every other rank is imagined to hold exactly what this
rank holds. The collectives then have definite, real results, computed here:

- all-gather: every rank's slot of the output is a copy of this rank's input (the output is
  this rank's shard tiled N times), never zeros or uninitialised memory;
- reduce-scatter: this rank's piece of the input, reduced over N equal copies (``SUM``: times
  N, ``AVG``, ``MAX``, ``MIN``: itself), written into the correctly sized output;
- all-reduce: the same reduction over N equal copies, in place;
- broadcast and barrier: nothing to do (the root holds what this rank holds).

Step times measured on it are the compute side of an N-rank step (the collectives cost a
local copy, made inline on the step's thread; :func:`collective_seconds` counts that time, so
the bench can also report a step without it). Models train on real values: a gathered
weight is this rank's rows repeated, so the loss moves like a real run's, if not along the
same path.

:func:`init_fake_world` registers the backend with ``torch.distributed`` (the way
``torch.testing._internal.distributed.fake_pg`` registers its data-free ``fake`` backend)
and starts the default process group on it; ``dist.new_group`` and ``DeviceMesh`` then make
more groups of the same kind. The groups are Python ``ProcessGroup`` subclasses, so the
``torch.distributed`` calls (FSDP2, DDP) and the functional collectives that compiled graphs
call (``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``,
their coalesced forms, ``wait_tensor``) reach them; ``all_gather_into_tensor_out``, whose
C++ kernel does not consult a Python group, is routed to it by a kernel registered here for
the lifetime of the fake world.

Every group also registers the fake world's device type (``cpu``, or ``cuda`` with
``init_fake_world(device="cuda")``) the way ``init_process_group`` registers gloo or NCCL
on a real group, so code that asks a group for its device finds one:
``group._device_types``, ``distributed_c10d._get_pg_default_device(group)`` and
``group._get_backend(device)`` answer as for gloo on the CPU and NCCL on CUDA. The backend
registered there is torch's ``FakeProcessGroup`` with ``error_on_collective``: it never
computes anything (the group's own methods do), it only answers questions such as
``supports_time_estimate`` (False: Inductor's collective estimators fall back to their
analytical model), and raises if a collective ever reached it instead of the group.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

__all__ = [
    "BACKEND",
    "FakeWorldGroup",
    "LoggedCollective",
    "collective_log",
    "collective_seconds",
    "init_fake_world",
    "register_backend",
    "shutdown_fake_world",
]

BACKEND = "fakeworld"

Tensor = torch.Tensor
Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class LoggedCollective:
    """One collective a fake-world group ran: its kind and the bytes of its full buffer."""

    kind: str
    full_bytes: int


_LOG: list[LoggedCollective] | None = None


@contextlib.contextmanager
def collective_log() -> Iterator[list[LoggedCollective]]:
    """Record the collectives every fake-world group runs inside the block into a list."""
    global _LOG
    previous, _LOG = _LOG, []
    try:
        yield _LOG
    finally:
        _LOG = previous


def _log(kind: str, tensors: list[torch.Tensor]) -> None:
    if _LOG is not None:
        _LOG.append(LoggedCollective(kind, sum(t.numel() * t.element_size() for t in tensors)))


# Seconds the fake-world groups of this process have spent in their collectives (one cell:
# the running total that :func:`_timed` adds to).
_SECONDS = [0.0]


def collective_seconds() -> float:
    """Wall-clock seconds every fake-world group of this process has spent computing its
    collectives so far (a running total: take differences). On CUDA it is the time to issue
    the copies, not to run them."""
    return _SECONDS[0]


def _timed(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` adding its wall-clock time to :func:`collective_seconds`."""

    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            _SECONDS[0] += time.perf_counter() - start

    return timed


def _done(result: Any) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(future)


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise RuntimeError("fake-world collectives need contiguous tensors")
    return t.view(-1)


class FakeWorldGroup(dist.ProcessGroup):
    """Rank ``rank`` of a ``size``-rank group whose other ranks hold what this one holds.

    Every collective is computed locally from that rule (see the module docstring) and
    returns a completed ``Work``; Dynamo does not trace into them (a real group's methods
    are C++ too), so a compiled model that calls one eagerly (DDP's buffer broadcast) sees
    the same opaque call as with gloo. Method names cover both the torch 2.13 names
    (``all_gather_single``, ``reduce_scatter_single`` and their ``_coalesced`` forms) and the
    older ones (``_allgather_base``, ``_reduce_scatter_base``, ``allgather_into_tensor_coalesced``,
    ``reduce_scatter_tensor_coalesced``).
    """

    def __init__(self, rank: int, size: int, device: str = "cpu") -> None:
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._group_name = ""
        self._group_desc = ""
        _register_device(self, device)

    # -- identity (the C++ base keeps no name for a Python group)

    def getBackendName(self) -> str:  # noqa: N802 (the C++ virtual's name)
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    # -- point to point: no rule gives another rank's data

    def send(self, tensors: Tensors, dst: int, tag: int = 0) -> dist.Work:
        """Not supported: a fake world has no other rank to send to."""
        raise NotImplementedError("fake-world groups have no point-to-point send")

    def recv(self, tensors: Tensors, src: int, tag: int = 0) -> dist.Work:
        """Not supported: another rank's data is unknown."""
        raise NotImplementedError("fake-world groups have no point-to-point recv")

    def recv_anysource(self, tensors: Tensors, tag: int = 0) -> dist.Work:
        """Not supported: another rank's data is unknown."""
        raise NotImplementedError("fake-world groups have no point-to-point recv")

    # -- arithmetic of N equal contributions

    def _reduce_(self, t: Tensor, op: Any) -> Tensor:
        """``t`` replaced in place by the reduction of ``size`` copies of itself under ``op``."""
        red = dist.ReduceOp
        if op == red.SUM:
            return t.mul_(self._size)
        if any(op == kind for kind in (red.AVG, red.MAX, red.MIN, red.BAND, red.BOR)):
            return t
        if op == red.PRODUCT:
            return t.pow_(self._size)
        raise NotImplementedError(f"fake-world reduction {op} (only SUM, AVG, MAX, MIN, ...)")

    def _gather_into(self, out: Tensor, inp: Tensor) -> None:
        flat_out, flat_in = _flat(out), _flat(inp)
        if flat_out.numel() != self._size * flat_in.numel():
            raise RuntimeError(
                f"all-gather output has {flat_out.numel()} elements, expected "
                f"{self._size} x {flat_in.numel()}"
            )
        flat_out.view(self._size, -1).copy_(flat_in.unsqueeze(0).expand(self._size, -1))

    def _scatter_into(self, out: Tensor, inp: Tensor, op: Any) -> None:
        flat_out, flat_in = _flat(out), _flat(inp)
        if flat_in.numel() != self._size * flat_out.numel():
            raise RuntimeError(
                f"reduce-scatter input has {flat_in.numel()} elements, expected "
                f"{self._size} x {flat_out.numel()}"
            )
        flat_out.copy_(flat_in.view(self._size, -1)[self._rank])
        self._reduce_(flat_out, op)

    # -- all-gather

    def all_gather_single(self, out: Tensor, inp: Tensor, opts: Any = None) -> dist.Work:
        """``out`` (``size`` x the input) filled with copies of ``inp``."""
        _log("all_gather", [out])
        self._gather_into(out, inp)
        return _done([out])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outs: Tensors, inps: Tensors, opts: Any = None
    ) -> dist.Work:
        """:meth:`all_gather_single` on each pair of ``outs`` and ``inps``."""
        _log("all_gather", list(outs))
        for out, inp in zip(outs, inps, strict=True):
            self._gather_into(out, inp)
        return _done(list(outs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, out_lists: list[Tensors], inps: Tensors, opts: Any = None) -> dist.Work:
        """Every tensor of ``out_lists[i]`` (one per rank) a copy of ``inps[i]``."""
        _log("all_gather", [t for outs in out_lists for t in outs])
        for outs, inp in zip(out_lists, inps, strict=True):
            for out in outs:
                out.copy_(inp)
        return _done(out_lists)

    def allgather_coalesced(
        self, out_lists: list[Tensors], inps: Tensors, opts: Any = None
    ) -> dist.Work:
        """``out_lists[r][j]`` (rank r's tensor j) a copy of ``inps[j]``."""
        _log("all_gather", [t for outs in out_lists for t in outs])
        for outs in out_lists:
            for out, inp in zip(outs, inps, strict=True):
                out.copy_(inp)
        return _done(out_lists)

    # -- reduce-scatter

    def reduce_scatter_single(self, out: Tensor, inp: Tensor, opts: Any) -> dist.Work:
        """``out`` = this rank's piece of ``inp``, reduced over ``size`` equal copies."""
        _log("reduce_scatter", [inp])
        self._scatter_into(out, inp, opts.reduceOp)
        return _done([out])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outs: Tensors, inps: Tensors, opts: Any) -> dist.Work:
        """:meth:`reduce_scatter_single` on each pair of ``outs`` and ``inps``."""
        _log("reduce_scatter", list(inps))
        for out, inp in zip(outs, inps, strict=True):
            self._scatter_into(out, inp, opts.reduceOp)
        return _done(list(outs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outs: Tensors, in_lists: list[Tensors], opts: Any) -> dist.Work:
        """``outs[i]`` = ``in_lists[i][rank]`` reduced over ``size`` equal copies."""
        _log("reduce_scatter", [t for ins in in_lists for t in ins])
        for out, ins in zip(outs, in_lists, strict=True):
            out.copy_(ins[self._rank])
            self._reduce_(out, opts.reduceOp)
        return _done(outs)

    # -- all-reduce, reduce, broadcast, barrier, all-to-all

    def allreduce(self, tensors: Tensors, opts: Any = None) -> dist.Work:
        """Each tensor reduced in place over ``size`` equal copies (``SUM`` by default)."""
        _log("all_reduce", list(tensors))
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        for t in tensors:
            self._reduce_(t, op)
        return _done(tensors)

    allreduce_coalesced = allreduce

    def reduce(self, tensors: Tensors, opts: Any) -> dist.Work:
        """Reduced in place on the root only (other ranks' buffers are left as they are)."""
        _log("reduce", list(tensors))
        if opts.rootRank == self._rank:
            for t in tensors:
                self._reduce_(t, opts.reduceOp)
        return _done(tensors)

    def broadcast(self, tensors: Tensors, opts: Any = None) -> dist.Work:
        """Nothing to copy: the root holds what this rank holds."""
        _log("broadcast", list(tensors))
        return _done(tensors)

    def scatter(self, outs: Tensors, in_lists: list[Tensors], opts: Any) -> dist.Work:
        """From the root (this rank) only: ``outs[0]`` = the root's piece for this rank."""
        if opts.rootRank != self._rank:
            raise NotImplementedError("fake-world scatter from another rank (its data is unknown)")
        _log("scatter", [t for ins in in_lists for t in ins])
        outs[0].copy_(in_lists[0][self._rank])
        return _done(outs)

    def gather(self, out_lists: list[Tensors], inps: Tensors, opts: Any) -> dist.Work:
        """To the root: every rank's slot a copy of this rank's input."""
        _log("gather", list(inps))
        if opts.rootRank == self._rank:
            for out in out_lists[0]:
                out.copy_(inps[0])
        return _done(out_lists)

    def barrier(self, opts: Any = None) -> dist.Work:
        """Nothing to wait for."""
        return _done(None)

    def alltoall_base(
        self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int],
        opts: Any = None,
    ) -> dist.Work:  # fmt: skip
        """Equal splits only: every rank sends this rank its piece, so ``out`` tiles it."""
        if list(out_splits) or list(in_splits):
            raise NotImplementedError("fake-world all-to-all takes equal splits only")
        _log("all_to_all", [inp])
        piece = _flat(inp).view(self._size, -1)[self._rank]
        _flat(out).view(self._size, -1).copy_(piece.unsqueeze(0).expand(self._size, -1))
        return _done([out])

    all_to_all_single = alltoall_base


_COLLECTIVES = (
    "all_gather_single", "_allgather_base", "all_gather_single_coalesced",
    "allgather_into_tensor_coalesced", "allgather", "allgather_coalesced",
    "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "reduce_scatter", "allreduce", "allreduce_coalesced",
    "reduce", "broadcast", "scatter", "gather", "barrier", "alltoall_base", "all_to_all_single",
)  # fmt: skip
for _name in _COLLECTIVES:  # timed, and opaque to Dynamo, like a C++ group's methods
    setattr(FakeWorldGroup, _name, torch._dynamo.disable(_timed(getattr(FakeWorldGroup, _name))))


def _device_backend(rank: int, size: int) -> Any:
    """torch's ``FakeProcessGroup`` backend, set to raise on any collective (where the
    torch version has that option): registered for a device, never used to compute."""
    from torch._C._distributed_c10d import FakeProcessGroup

    create = getattr(FakeProcessGroup, "_create_internal", None)
    if create is None:  # older torch: a public constructor
        return FakeProcessGroup(rank, size)
    options_class = getattr(FakeProcessGroup, "Options", None)
    if options_class is None or not hasattr(options_class(), "error_on_collective"):
        return create(rank, size)
    options = options_class()
    options.error_on_collective = True
    return create(rank, size, options)


def _register_device(group: dist.ProcessGroup, device: str) -> None:
    """Register ``device``'s type with ``group`` (as ``init_process_group`` registers gloo on
    ``cpu`` or NCCL on ``cuda``) and make it the group's default backend."""
    backend_type = dist.ProcessGroup.BackendType.CUSTOM
    backend = _device_backend(group.rank(), group.size())
    group._register_backend(torch.device(device), backend_type, backend)
    group._set_default_backend(backend_type)


# The device type every new fake-world group registers (set by :func:`init_fake_world`).
_DEVICE = "cpu"


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> FakeWorldGroup:
    return FakeWorldGroup(rank, size, _DEVICE)


def register_backend() -> None:
    """Register :data:`BACKEND` with ``torch.distributed`` (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])


def _all_gather_into_tensor_out(
    inp: Tensor, group_size: int, group_name: str, *, out: Tensor
) -> Tensor:
    group = dist.distributed_c10d._resolve_process_group(group_name)
    if not isinstance(group, FakeWorldGroup):  # never happens: installed for fake worlds only
        raise RuntimeError(f"all_gather_into_tensor_out on {type(group).__name__} in fake world")
    group.all_gather_single(out, inp.contiguous())
    return out


_OUT_LIBRARY: torch.library.Library | None = None


def _route_out_variant() -> None:
    """Send ``_c10d_functional.all_gather_into_tensor_out`` to the fake-world group."""
    global _OUT_LIBRARY
    if _OUT_LIBRARY is not None:
        return
    import warnings

    lib = torch.library.Library("_c10d_functional", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel"
        warnings.simplefilter("ignore")
        for key in ("CPU", "CUDA"):
            lib.impl("all_gather_into_tensor_out", _all_gather_into_tensor_out, key)
    _OUT_LIBRARY = lib


def init_fake_world(world_size: int, rank: int = 0, device: str = "cpu") -> None:
    """Start the default process group as rank ``rank`` of a fake world of ``world_size``.

    Nothing else runs: the other ranks are imagined (see the module docstring). ``device``
    (``"cpu"`` or ``"cuda"``) is the device type every group of the world registers, the one
    ``_get_pg_default_device`` answers (as gloo's groups answer ``cpu`` and NCCL's ``cuda``);
    the groups' collectives serve CPU and CUDA tensors either way.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    global _DEVICE
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"a fake world's device is 'cpu' or 'cuda', not {device!r}")
    register_backend()
    _DEVICE = device
    _route_out_variant()
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(BACKEND, store=FakeStore(), rank=rank, world_size=world_size)


def shutdown_fake_world() -> None:
    """Destroy the fake world's process groups and restore ``all_gather_into_tensor_out``'s
    own kernels (for a process that goes on without it, such as a test session)."""
    global _OUT_LIBRARY, _DEVICE
    if dist.is_initialized():
        dist.destroy_process_group()
    _DEVICE = "cpu"
    if _OUT_LIBRARY is not None:
        _OUT_LIBRARY._destroy()
        _OUT_LIBRARY = None
