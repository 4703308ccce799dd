"""``CPUOffload``: keep shards, gradients and optimizer state in host memory.

Like FSDP2's ``CPUOffloadPolicy``: the parameters stay DTensors sharded over the mesh's
process groups, but their local tensors (this rank's rows) live on the CPU, pinned when
asked. Each read copies the shard to the mesh's device (non-blocking, from pinned memory)
and gathers it there; each reduced gradient is copied back to the host, so ``.grad`` is a
CPU DTensor and the optimizer, with its state, steps on the host. The device holds only
what is gathered and the activations.

The DTensors of offloaded parameters are placed on a host-typed copy of the mesh (same
process groups and ranks, device type ``cpu``), not on the accelerator mesh itself:
``DTensor.to_local()``'s backward rebuilds the gradient with ``DTensor.from_local``, which
moves it to the mesh's device type, so on an accelerator mesh every gradient would be
copied back to the device after ``reduce_grad`` brought it to the host, and autograd
would refuse the device gradient for the host parameter. (FSDP2 builds its parameters on
the accelerator mesh, but never differentiates through ``to_local``.)

Buffers (BatchNorm statistics, rotary tables) are not sharded and are read by the compute,
so they live on the mesh's device, as with FSDP2: ``shard()`` moves them there, whatever
device the model was built on, and after a ``to_empty(device="cpu")`` or ``.to("cpu")`` of
the offloaded model (the meta-device recipe) they are moved back (:func:`buffers_to_device`,
:func:`keep_buffers_on_device`).

Eagerly the marker kernels (``graphshard.api.eager_kernels``) make the copies; compiled, the
lowering passes insert them as graph nodes and ``prefetch`` issues each bucket's host-to-device
copies together with its all-gather.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh

from graphshard.errors import GraphshardTypeError, GraphshardValueError

__all__ = [
    "CPUOffload", "resolve_offload", "host_mesh", "buffers_to_device", "keep_buffers_on_device",
    "host_standing_in_for_device",
]

_host_stands_in = False  # see host_standing_in_for_device


@contextlib.contextmanager
def host_standing_in_for_device() -> Iterator[None]:
    """Within it, ``shard(..., offload=CPUOffload(pin_memory=False))`` on a CPU mesh offloads
    with the host standing in for the accelerator, instead of refusing: the shards rest on
    the host and are copied to the host before each gather, the reduced gradients back to it.
    The graphs then hold every offload copy, and Inductor compiles them for the CPU: a check
    of offload's graphs and numerics on a machine without an accelerator (the copies cost
    time and save nothing: not for training). Read by ``shard()`` only; not thread-safe."""
    global _host_stands_in
    before, _host_stands_in = _host_stands_in, True
    try:
        yield
    finally:
        _host_stands_in = before


@dataclass(frozen=True)
class CPUOffload:
    """Keep the shards, gradients and optimizer state on the host; given to
    ``graphshard.shard(model, mesh, offload=CPUOffload())``.

    The mesh must be an accelerator mesh (``init_device_mesh("cuda", ...)``): compute and
    collectives run on its device; only the shards rest on the CPU.

    Attributes:
        pin_memory: pin (page-lock) the host shards, so that each bucket's copy to the
            device is asynchronous and overlaps compute. Without it every copy is
            synchronous; turn it off only when pinned memory is scarce.
    """

    pin_memory: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise GraphshardTypeError(
                f"CPUOffload.pin_memory must be True or False, got {self.pin_memory!r}."
            )


def resolve_offload(
    mesh: DeviceMesh, offload: CPUOffload | None
) -> tuple[str, DeviceMesh | None]:
    """The device type the shards are copied to before each gather and the host mesh their
    DTensors live on: ``("", None)`` without offload, else the mesh's (accelerator) device
    type and :func:`host_mesh` of ``mesh``.

    Raises:
        TypeError: ``offload`` is not a :class:`CPUOffload`.
        ValueError: the mesh is on the CPU, so there is nothing to offload.
    """
    if offload is None:
        return "", None
    if not isinstance(offload, CPUOffload):
        hint = ""
        if type(offload).__name__ == "CPUOffloadPolicy":  # FSDP2's
            pin = getattr(offload, "pin_memory", True)
            hint = f": FSDP2's policy; graphshard's is CPUOffload(pin_memory={pin!r})"
        elif offload is True:
            hint = ": CPUOffload() offloads"
        raise GraphshardTypeError(
            f"offload must be a graphshard.CPUOffload (or None), got {type(offload).__name__}"
            f"{hint}."
        )
    device_type = mesh.device_type
    if device_type == "cpu" and _host_stands_in:
        return device_type, host_mesh(mesh)
    if device_type == "cpu":
        raise GraphshardValueError(
            "graphshard.shard(..., offload=CPUOffload()) keeps the shards in host memory and "
            "computes on the mesh's device, but this mesh is on 'cpu': parameters, gradients "
            "and optimizer state already live in host memory, so there is nothing to offload. "
            "Drop offload=, or shard on an accelerator mesh, e.g. graphshard.shard(model, "
            "init_device_mesh('cuda', (world_size,)), offload=graphshard.CPUOffload())."
        )
    return device_type, host_mesh(mesh)


def host_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A ``cpu`` DeviceMesh over the same process groups and ranks as ``mesh``."""
    names = mesh.mesh_dim_names
    with unset_fake_temporarily():  # the mesh holds real rank ids, also when tracing
        if mesh.ndim == 1:
            return DeviceMesh.from_group(mesh.get_group(), "cpu", mesh_dim_names=names)
        groups = [mesh.get_group(d) for d in range(mesh.ndim)]
        names = names or tuple(f"dim{d}" for d in range(mesh.ndim))
        return DeviceMesh.from_group(groups, "cpu", mesh.mesh, mesh_dim_names=names)



def buffers_to_device(module: nn.Module, device_type: str) -> None:
    """Move every buffer of ``module`` (not yet on the meta device) to ``device_type``, in
    place in its owner's ``_buffers`` (so persistence and names are kept)."""
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is None or buffer.is_meta or buffer.device.type == device_type:
                continue
            sub._buffers[name] = buffer.to(device_type)


def keep_buffers_on_device(module: nn.Module, device_type: str) -> None:
    """After any ``_apply`` of the offloaded root (``to_empty(device="cpu")``, ``.to("cpu")``,
    ``.float()``), move the buffers back to ``device_type``: the shards stay where the call
    put them (the host), the compute that reads the buffers runs on the device."""
    cls = type(module)

    def _apply(self, fn, recurse: bool = True):
        out = super(offloaded, self)._apply(fn, recurse)
        buffers_to_device(self, device_type)
        return out

    offloaded = type(cls.__name__, (cls,), {"_apply": _apply, "__module__": cls.__module__})
    module.__class__ = offloaded
