"""Trace CPU offload on a fake accelerator, in a process of its own (used by test_offload.py).

This CPU-only torch cannot differentiate through fake ``cuda`` tensors: autograd asks the
device guard of CUDA, which is not built in, and aborts the process. A PrivateUse1 device
registered from Python (``torch.utils.backend_registration``) has a device guard, so under
``FakeTensorMode`` it stands in for the accelerator: Dynamo, AOTAutograd, the partitioner and
the passes run exactly as for ``cuda``. Registering it is process-wide and cannot be undone
(it becomes torch's accelerator, which breaks CUDA autograd on a GPU machine), so it happens
only in a spawned process; what comes back is a plain summary of each graph's nodes.
"""

from __future__ import annotations

from typing import Any

import torch
from graph_utils import Block
from torch import fx, nn

from graphshard.tools.offline import FAKE_ACCELERATOR as ACCEL
from graphshard.tools.offline import register_fake_accelerator


class ThreeBlock(nn.Module):
    """Three blocks and a head with odd sizes: four buckets, padded pieces."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _target(node: fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    return str(node.target)


def _val(value: Any) -> dict[str, Any]:
    if not isinstance(value, torch.Tensor):
        return {"device": None, "nbytes": 0, "dtype": None}
    return {"device": value.device.type, "nbytes": value.numel() * value.element_size(),
            "dtype": str(value.dtype).removeprefix("torch.")}


def summarize(gm: fx.GraphModule) -> list[dict[str, Any]]:
    """One plain record per node, in graph order."""
    records = []
    for node in gm.graph.nodes:
        tag = node.meta.get("graphshard") or {}
        records.append({
            "name": node.name,
            "target": _target(node),
            "inputs": [a.name for a in node.all_input_nodes],
            "args": [a.name if isinstance(a, fx.Node) else str(a) for a in node.args],
            "kwargs": {k: str(v) for k, v in node.kwargs.items()},
            "copy": node.meta.get("graphshard_copy"),
            "kind": tag.get("kind"),
            "bucket": tag.get("bucket"),
            "params": tag.get("params"),
            **_val(node.meta.get("val")),
        })  # fmt: skip
    return records


def trace(
    offload: bool,
    *,
    mesh_shape: tuple[int, ...] = (2,),
    param_dtype: str | None = None,
    no_sync_first: bool = False,
    reshard_after_forward: bool | str = True,
    **backend_options: Any,
) -> dict[str, Any]:
    """Shard ``ThreeBlock`` on a fake accelerator mesh (with or without offload), run one
    compiled step and one eager step on fake tensors; summarise graphs and devices."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    import graphshard
    from graphshard.api.sharding import shard_state
    from graphshard.passes.reshard import reshard_choice
    from graphshard.tools.offline import fake_process_group

    register_fake_accelerator()
    world = 1
    for size in mesh_shape:
        world *= size
    with fake_process_group(world):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            torch.manual_seed(0)
            model = ThreeBlock()  # initialised on the host, as offloaded models are
        names = ("replicate", "shard") if len(mesh_shape) == 2 else None
        mesh = init_device_mesh(ACCEL, mesh_shape, mesh_dim_names=names)
        mp = None
        if param_dtype is not None:
            mp = graphshard.MixedPrecision(param_dtype=getattr(torch, param_dtype))
        with mode:
            graphshard.shard(model, mesh, mixed_precision=mp,
                             reshard_after_forward=reshard_after_forward,
                             offload=graphshard.CPUOffload() if offload else None)
        state = shard_state(model)
        shard_bytes = {}  # name -> bytes of this rank's shard (its local tensor)
        for entry in state.params:
            local = entry.param.to_local()
            shard_bytes[entry.names[0]] = local.numel() * local.element_size()
        result: dict[str, Any] = {
            "shard_bytes": shard_bytes,
            "buckets": {e.names[0]: e.bucket for e in state.params},
            "param_devices": sorted({p.to_local().device.type for p in model.parameters()}),
            "param_mesh": sorted({p.device_mesh.device_type for p in model.parameters()}),
            "state_mesh": state.mesh.device_type,
        }

        with mode:  # eager: the marker kernels' fake implementations, autograd as it runs
            x = torch.randn(4, 8, device=ACCEL)
            out = model(x)
            out.sum().backward()
        result["eager_output"] = out.device.type
        result["eager_grads"] = sorted({p.grad.to_local().device.type for p in model.parameters()})
        model.zero_grad(set_to_none=True)

        backend = graphshard.backend(inductor=False, **backend_options)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        with mode:
            if no_sync_first:
                with graphshard.no_sync(model):
                    compiled(x).sum().backward()
                result["accumulators"] = sorted(
                    {e.unreduced.grad.device.type for e in state.params}
                )
            out = compiled(x)
            out.sum().backward()
        from graphshard.safety.fingerprint import shard_fingerprint

        fp = shard_fingerprint(state)
        result["fingerprint"] = {k: v for k, v in fp.items() if k.startswith("shard option")}
        with mode, torch.no_grad():  # evaluation: the inference graph gathers from the host too
            compiled(x)
        result["compiled_output"] = out.device.type
        result["compiled_grads"] = sorted({p.grad.to_local().device.type
                                           for p in model.parameters()})
        with mode:  # the optimizer steps where the shards and gradients are
            optimizer = torch.optim.AdamW(model.parameters())
            optimizer.step()
        result["optimizer_state"] = sorted({
            value.to_local().device.type for state_ in optimizer.state.values()
            for value in state_.values() if isinstance(value, torch.Tensor) and value.dim()
        })
        result["graphs"] = [{stage: summarize(gm) for stage, gm in stages.items()}
                            for stages in backend.graphs]
        from graphshard.passes.traffic import step_traffic

        try:  # what the bench's "copies MB" column reads (its error, if it raised)
            result["traffic"] = step_traffic(backend.graphs).moved
        except Exception as exc:
            result["traffic"] = f"{type(exc).__name__}: {exc}"
        joint = backend.graphs[0].get("joint")
        choice = None if joint is None else reshard_choice(joint)
        if choice is not None:  # reshard_after_forward="auto": what it chose, and why
            result["reshard"] = {
                "state_bytes": choice.state_bytes, "fits": choice.fits,
                "keep_all_peak": choice.keep_all_peak_bytes,
                "keep": {b.bucket: b.keep for b in choice.buckets if b.auto},
                "added_s": {b.bucket: b.added_s for b in choice.buckets if b.auto},
            }
    return result


def kernels() -> dict[str, Any]:
    """The eager kernels of the markers, called directly on fake tensors: where their
    results land, and the copies they make, in order."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphshard.api import eager_kernels as ops
    from graphshard.tools.offline import fake_process_group

    register_fake_accelerator()

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default:
                self.calls.append(
                    f"_to_copy(device={kwargs.get('device')}, dtype={kwargs.get('dtype')}, "
                    f"non_blocking={kwargs.get('non_blocking', False)})"
                )
            elif func is torch.ops.graphshard.to_host.default:
                self.calls.append(f"to_host({args[0].device.type} -> pinned host)")
            elif "_c10d_functional" in str(func) and "wait" not in str(func):
                self.calls.append(str(func).split(".")[1])
            return func(*args, **kwargs)

    with fake_process_group(2) as group, FakeTensorMode():
        shard = torch.randn(3, 8)  # rank 0's rows of a [5, 8] parameter, on the host
        with Log() as log:
            full = ops._unshard_eager(shard, [5, 8], 0, False, True, "w", 2, group.group_name,
                                      torch.bfloat16, None, "", 1, ACCEL)
        unshard_calls = log.calls
        grad = torch.randn(5, 8, device=ACCEL)
        with Log() as log:
            reduced = ops._reduce_grad_eager(grad, 0, "w", 2, group.group_name, None,
                                             torch.float32, "", 1, True, None, None, 3, "cpu")
        reduce_calls = log.calls
    return {
        "unshard": {"calls": unshard_calls, "device": full.device.type, "shape": list(full.shape),
                    "dtype": str(full.dtype)},
        "reduce_grad": {"calls": reduce_calls, "device": reduced.device.type,
                        "shape": list(reduced.shape)},
    }


def llama_recipe(recipe: str) -> dict[str, Any]:
    """FSDP2's two offload recipes on a tiny Llama (rotary tables as buffers), with no manual
    moves: ``"host"`` builds the model on the CPU, then shards it; ``"meta"`` builds it on
    the meta device, shards it, ``to_empty(device="cpu")`` and initialises it. Then one
    eager and one compiled forward and backward on the accelerator."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    import graphshard
    from graphshard.models.llama import Llama, llama_config
    from graphshard.tools.offline import fake_process_group

    register_fake_accelerator()

    def devices(tensors) -> list[str]:
        return sorted({t.device.type for t in tensors})

    with fake_process_group(2):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        cfg = llama_config("tiny", n_layers=2)
        mesh = init_device_mesh(ACCEL, (2,))
        if recipe == "meta":
            with torch.device("meta"):
                model = Llama(cfg)
        with mode:
            if recipe == "host":
                model = Llama(cfg)
            graphshard.shard(model, mesh, offload=graphshard.CPUOffload())
            result: dict[str, Any] = {"buffers_after_shard": devices(model.buffers())}
            if recipe == "meta":
                model.to_empty(device="cpu")
                model.init_weights(seed=0)
            result["buffers"] = devices(model.buffers())
            result["shards"] = devices(p.to_local() for p in model.parameters())
            tokens = torch.randint(0, cfg.vocab_size, (2, 16), device=ACCEL)
            model(tokens).loss.backward()
            result["eager_grads"] = devices(p.grad.to_local() for p in model.parameters())
            model.zero_grad(set_to_none=True)
        backend = graphshard.backend(inductor=False)
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        with mode:
            loss = compiled(tokens).loss
            loss.backward()
        result["loss"] = loss.device.type
        result["compiled_grads"] = devices(p.grad.to_local() for p in model.parameters())
        result["h2d_copies"] = sum(
            1 for stages in backend.graphs for gm in stages.values() for n in gm.graph.nodes
            if (n.meta.get("graphshard_copy") or {}).get("direction") == "h2d")
    return result


# Copies on the compute stream: both copy streams off, the layout most tests read
# (the copy streams are on by default; their configurations name them).
_SERIAL = {"grad_copy_stream": False, "shard_copy_stream": False}

CONFIGS: dict[str, dict[str, Any]] = {
    "plain": {"offload": False, **_SERIAL},
    "offload": {"offload": True, **_SERIAL},
    "hsdp": {"offload": True, "mesh_shape": (2, 2), **_SERIAL},
    "bf16": {"offload": True, "param_dtype": "bfloat16", **_SERIAL},
    "no_sync": {"offload": True, "no_sync_first": True, **_SERIAL},
    "kept": {"offload": True, "reshard_after_forward": False, **_SERIAL},
    "copy_stream": {"offload": True, "grad_copy_stream": True, "shard_copy_stream": False},
    "shard_stream": {"offload": True, "shard_copy_stream": True, "grad_copy_stream": False},
    "default": {"offload": True},  # both copy streams, by default
    "both_streams": {"offload": True, "shard_copy_stream": True, "grad_copy_stream": True},
    # HSDP, bf16 and a no_sync step first, without and with both copy streams
    "mixed": {"offload": True, "mesh_shape": (2, 2), "param_dtype": "bfloat16",
              "no_sync_first": True, **_SERIAL},
    "mixed_streams": {"offload": True, "mesh_shape": (2, 2), "param_dtype": "bfloat16",
                      "no_sync_first": True, "shard_copy_stream": True,
                      "grad_copy_stream": True},
}


def auto_reshard() -> dict[str, Any]:
    """``reshard_after_forward="auto"`` with and without offload, then offloaded under a
    budget of exactly its predicted keep-all peak: each one's choice."""
    plain = trace(False, reshard_after_forward="auto")["reshard"]
    offloaded = trace(True, reshard_after_forward="auto")["reshard"]
    budgeted = trace(True, reshard_after_forward="auto",
                     memory_budget=offloaded["keep_all_peak"])["reshard"]
    return {"plain": plain, "offloaded": offloaded, "budgeted": budgeted}


def trace_all() -> dict[str, Any]:
    """Every configuration of :data:`CONFIGS`, and :func:`kernels`; a configuration that
    raises gives ``{"error": traceback}`` (the others still run)."""
    import traceback

    jobs = {name: (trace, options) for name, options in CONFIGS.items()}
    jobs["kernels"] = (kernels, {})
    jobs["auto"] = (auto_reshard, {})
    for recipe in ("host", "meta"):
        jobs[f"llama_{recipe}"] = (llama_recipe, {"recipe": recipe})
    results: dict[str, Any] = {}
    for name, (fn, options) in jobs.items():
        try:
            results[name] = fn(**options)
        except Exception:  # reported by the tests that read this configuration
            results[name] = {"error": traceback.format_exc()}
    return results
