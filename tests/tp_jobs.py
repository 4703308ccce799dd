"""What each rank runs for tests/test_tensor_parallel.py: torch's ``parallelize_module`` on
``mesh["tp"]``, then ``graphshard.shard(model, mesh["dp"])`` (or ``mesh["replicate",
"shard"]``), trained a few steps; plus the single-process references."""

from __future__ import annotations

import contextlib

import torch
from dist_utils import full_state
from torch import nn

import graphshard
from graphshard.models.llama import Llama, llama_config, tensor_parallel_plan

STEPS = 3
MODES = ("eager", "compiled")
BF16 = graphshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


class MLP(nn.Module):
    """Odd sizes on purpose: 10 and 7 rows split unevenly over dp 2 x tp 2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def mlp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def mlp_batch(step: int, dp: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + dp)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 7, generator=gen)


def tokens(step: int, dp: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100 * step + dp))


def _mlp_loss(run, step: int, dp: int, micro: int = 0) -> torch.Tensor:
    x, y = mlp_batch(step, dp, micro)
    out = run(x)
    # in fp32 (as mse_loss promotes a bf16 output anyway): torch 2.11's mse_loss backward
    # fails on a bf16 output against fp32 targets
    return nn.functional.mse_loss(out.to(y.dtype), y)


def _tp_model(kind: str, tp_mesh, dp_mesh, policy=None, seed: int = 0) -> nn.Module:
    """``kind``: "mlp", "llama" (Megatron TP plan) or "llama_sp" (plus sequence parallel)."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(seed)
    if kind == "mlp":
        model, plan = MLP(), mlp_plan()
    else:
        model = Llama(llama_config("tiny"))
        plan = tensor_parallel_plan(model, sequence_parallel=kind == "llama_sp")
    parallelize_module(model, tp_mesh, plan)
    return graphshard.shard(model, dp_mesh, mixed_precision=policy)


def _grad_norm(model: nn.Module) -> float:
    """torch's global gradient norm (``clip_grad_norm_`` with no limit) over the DTensors."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    return (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()


def _optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "adafactor":  # its factored state, reduced across dp and tp shards
        return torch.optim.Adafactor(params, lr=lr / 10)
    return torch.optim.SGD(params, lr=lr)


def _train(model, mode: str, dp: int, kind: str, accum: int = 1, lr: float = 0.1,
           optimizer: str = "sgd") -> dict:
    """SGD steps (or ``optimizer``'s); with ``accum`` > 1 every micro-batch but the last runs
    under no_sync.
    ``mode``: "eager", "compiled" (Inductor) or "lowered" (the passes without Inductor).
    Losses per step (summed over micro-batches) and torch's global gradient norms."""
    torch._dynamo.reset()
    if mode == "eager":
        run = model
    else:  # "compiled": through Inductor; "lowered": graphshard's transformed graphs run op by op
        run = torch.compile(model, backend=graphshard.backend(inductor=mode == "compiled"))
    opt = _optimizer(optimizer, model.parameters(), lr)
    losses, norms = [], []
    for step in range(STEPS):
        total = 0.0
        for micro in range(accum):
            held = graphshard.no_sync(model) if micro < accum - 1 else contextlib.nullcontext()
            with held:
                if kind == "mlp":
                    loss = _mlp_loss(run, step, dp, micro)
                else:
                    loss = run(tokens(step, dp)).loss
                loss.backward()
            total += loss.item()
        norms.append(_grad_norm(model))
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return {"losses": losses, "norms": norms}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def dp_tp_job(rank: int, world_size: int, save_dir: str) -> dict:
    """dp 2 x tp 2: plain, no_sync and bf16 training, state dicts, DCP, and bad orders."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_coordinate()[0]
    out: dict = {"dp": dp}
    for mode in MODES:
        model = _tp_model("mlp", mesh["tp"], mesh["dp"])
        out[("mlp", mode)] = {
            **_train(model, mode, dp, "mlp"),
            "placements": {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters()},
            "params": _params(model),
        }
        cheap = "lowered" if mode == "compiled" else mode  # Inductor is covered above
        model = _tp_model("mlp", mesh["tp"], mesh["dp"])
        out[("no_sync", mode)] = {**_train(model, cheap, dp, "mlp", accum=2),
                                  "params": _params(model)}
        model = _tp_model("llama", mesh["tp"], mesh["dp"])
        out["llama_meshes"] = {n: (p.device_mesh.mesh_dim_names, tuple(map(repr, p.placements)))
                               for n, p in model.named_parameters()}
        out[("llama", mode)] = {**_train(model, mode, dp, "llama", lr=0.5),
                                "params": _params(model)}
        if mode == "eager":
            out["state"] = _state_dict_round_trip(model, mesh, save_dir)
            for kind in ("mlp", "llama"):  # the optimizer steps outside the compiled graphs
                model = _tp_model(kind, mesh["tp"], mesh["dp"])
                out[("adafactor", kind)] = {
                    **_train(model, mode, dp, kind, lr=0.5 if kind == "llama" else 0.1,
                             optimizer="adafactor"),
                    "params": _params(model)}
        model = _tp_model("llama_sp", mesh["tp"], mesh["dp"])  # "llama" went through Inductor
        out[("llama_sp", mode)] = {**_train(model, cheap, dp, "llama", lr=0.5),
                                   "params": _params(model)}
        model = _tp_model("mlp", mesh["tp"], mesh["dp"], BF16)
        out[("bf16", mode)] = {**_train(model, cheap, dp, "mlp"), "params": _params(model)}
    out["fsdp2_bf16"] = _fsdp2_bf16(mesh, dp)
    out["checkpoint"] = _checkpoint_round_trip(mesh, dp, save_dir)
    out["errors"] = _bad_orders(mesh)
    return out


def _fsdp2_bf16(mesh, dp: int) -> dict:
    """PyTorch FSDP2 over the same TP model and bf16 policy: the peer's answer."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = MLP()
    parallelize_module(model, mesh["tp"], mlp_plan())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        loss = _mlp_loss(model, step, dp)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": _params(model)}


def _state_dict_round_trip(model, mesh, save_dir: str) -> dict:
    """torch's full state dict, and ``dcp.save`` / ``dcp.load`` into a fresh dp x tp model."""
    import torch.distributed.checkpoint as dcp

    full = full_state(model)
    dcp.save(model.state_dict(), checkpoint_id=save_dir)
    fresh = _tp_model("llama", mesh["tp"], mesh["dp"], seed=1)  # other values: load replaces
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=save_dir)
    fresh.load_state_dict(sd)
    return {"full": full, "reloaded": _params(fresh)}


def _checkpoint_round_trip(mesh, dp: int, save_dir: str) -> dict:
    """graphshard's checkpoints with Adam state, and ``load_full_checkpoint``, on dp x tp: a
    resumed run continues exactly as the one that never stopped."""
    import os

    import torch.distributed as dist

    def adam_step(model, opt, step: int) -> None:
        _mlp_loss(model, step, dp).backward()
        opt.step()
        opt.zero_grad()

    model = _tp_model("mlp", mesh["tp"], mesh["dp"])
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    adam_step(model, opt, 0)
    graphshard.save_checkpoint(os.path.join(save_dir, "ckpt"), model, opt, step=1)
    full = full_state(model)
    full_path = os.path.join(save_dir, "full.pt")
    if dist.get_rank() == 0:
        torch.save(full, full_path)
    dist.barrier()
    adam_step(model, opt, 1)

    resumed = _tp_model("mlp", mesh["tp"], mesh["dp"], seed=1)
    resumed_opt = torch.optim.Adam(resumed.parameters(), lr=0.01)
    graphshard.load_checkpoint(graphshard.latest_checkpoint(os.path.join(save_dir, "ckpt")),
                               resumed, resumed_opt)
    adam_step(resumed, resumed_opt, 1)
    loaded = _tp_model("mlp", mesh["tp"], mesh["dp"], seed=2)
    graphshard.load_full_checkpoint(loaded, full_path)
    return {"saved": full, "full_loaded": _params(loaded), "continued": _params(model),
            "resumed": _params(resumed)}


def _bad_orders(mesh) -> dict[str, str]:
    """The error each wrong order gives (``"no error"`` if none)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    def error(fn) -> str:
        try:
            fn()
        except Exception as err:  # noqa: BLE001  (the test reads the message)
            return f"{type(err).__name__}: {err}"
        return "no error"

    def tp_then(dp_mesh, **kwargs):
        torch.manual_seed(0)
        model = MLP()
        parallelize_module(model, mesh["tp"], mlp_plan())
        graphshard.shard(model, dp_mesh, **kwargs)

    def shard_then_tp():
        torch.manual_seed(0)
        model = graphshard.shard(MLP(), mesh["dp"])
        parallelize_module(model, mesh["tp"], mlp_plan())

    columns = init_device_mesh("cpu", (2, 2), mesh_dim_names=("row", "col"))
    return {
        "tp_after_shard": error(shard_then_tp),
        "no_mesh": error(lambda: tp_then(None)),
        "whole_mesh": error(lambda: tp_then(mesh)),
        "tp_mesh": error(lambda: tp_then(mesh["tp"])),
        "overlapping": error(lambda: tp_then(columns["col"])),
        "offload": error(lambda: tp_then(mesh["dp"], offload=graphshard.CPUOffload())),
    }


def hsdp_tp_job(rank: int, world_size: int) -> dict:
    """replicate 2 x shard 2 x tp 2 on 8 ranks: ``shard(model, mesh["replicate", "shard"])``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    replica, shard_index, _ = mesh.get_coordinate()
    dp = 2 * replica + shard_index
    out: dict = {"dp": dp}
    for mode in ("eager", "lowered"):  # 8 ranks on 2 cores: the passes, not Inductor
        model = _tp_model("mlp", mesh["tp"], mesh["replicate", "shard"])
        out[mode] = {
            **_train(model, mode, dp, "mlp"),
            "placements": {n: tuple(map(repr, p.placements)) for n, p in model.named_parameters()},
            "params": _params(model),
        }
    return out


def reference(kind: str, dp_ranks: int, accum: int = 1, lr: float = 0.1,
              optimizer: str = "sgd") -> dict:
    """One process: every dp rank's batches, gradients averaged over dp ranks and summed
    over micro-batches (what graphshard's dp reduction and no_sync must produce)."""
    torch.manual_seed(0)
    model = MLP() if kind == "mlp" else Llama(llama_config("tiny"))
    opt = _optimizer(optimizer, model.parameters(), lr)
    losses: list[list[float]] = [[] for _ in range(dp_ranks)]
    norms: list[float] = []
    for step in range(STEPS):
        totals = [0.0] * dp_ranks
        for micro in range(accum):
            for d in range(dp_ranks):
                if kind == "mlp":
                    loss = _mlp_loss(model, step, d, micro)
                else:
                    loss = model(tokens(step, d)).loss
                (loss / dp_ranks).backward()
                totals[d] += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item())
        opt.step()
        opt.zero_grad()
        for d in range(dp_ranks):
            losses[d].append(totals[d])
    return {"losses": losses, "norms": norms,
            "params": {n: p.detach() for n, p in model.named_parameters()}}
