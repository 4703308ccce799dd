"""Rank jobs of ``test_hf_load``: a Hugging Face Llama built empty, sharded, loaded from a
``save_pretrained`` directory and trained, against ``from_pretrained`` in one process.

Each job runs in "eager" or "compiled" mode (``torch.compile(model, backend="graphshard")``)
and returns plain tensors only. ``run_jobs`` runs every job of one ``run_ranks`` launch in
turn. The reference (``reference_train``) runs every rank's batch in one process and
averages the per-rank losses: the gradient the reduce-scatter averages.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import graphshard

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only: never the hub

MODES = ("eager", "compiled")
WAYS = ("rank0", "per_rank")  # rank 0 reads and broadcasts / every rank reads its rows
SEED = 1234
STEPS = 3
BATCH, SEQ = 2, 16
# Where from_config builds the model: nothing is allocated until to_empty, which gives every
# rank uninitialised storage for its shards and the buffers.
BUILD_DEVICE = torch.device("meta")


def config(tie: bool, other: bool = False):
    """The small Llama of the test, or (``other``) a different one: 3 layers and MLPs of 96.
    Its embedding and attention fit the test's model, so a load that did not check every
    shape first would copy them before failing on the MLP."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96 if other else 128,
        num_hidden_layers=3 if other else 2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=tie,
        use_cache=False,  # training, as docs/large-models.md says (blocks compiled once)
    )  # fmt: skip


def save_random(path: str, tie: bool, other: bool = False) -> None:
    """A randomly initialised model of ``config(tie, other)`` written by ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(SEED)
    AutoModelForCausalLM.from_config(config(tie, other)).save_pretrained(path)


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s token ids at ``step``, the same in every process."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 128, (BATCH, SEQ), generator=gen)


def loss_fn(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The causal LM loss of ``model`` predicting ``ids``."""
    return model(input_ids=ids, labels=ids).loss


def make_optimizer(params) -> torch.optim.Optimizer:
    """SGD with momentum: unlike Adam, it does not magnify round-off where a gradient is
    near zero (Inductor's fused kernels round differently from eager's)."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def train(model: nn.Module, opt: torch.optim.Optimizer, ranks: list[int]) -> list[float]:
    """``STEPS`` steps on the batches of ``ranks`` (their losses averaged); the losses."""
    model.train()
    losses = []
    for step in range(STEPS):
        loss = sum(loss_fn(model, batch(step, r)) for r in ranks) / len(ranks)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of ``t``: its full tensor when it is a DTensor."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().clone()


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name (tied ones under each name), full, as plain copies."""
    return {n: full(p) for n, p in model.named_parameters(remove_duplicate=False)}


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer by name, as plain copies."""
    return {n: b.detach().clone() for n, b in model.named_buffers()}


# --------------------------------------------------------------------------- rank jobs


def build_sharded(path: str) -> tuple[nn.Module, list[str]]:
    """The user's flow: the config of ``path``, the model built on ``BUILD_DEVICE``,
    sharded, then storage for this rank's shards (uninitialised). Also the devices of every
    local shard and buffer before ``to_empty``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    with BUILD_DEVICE:
        model = AutoModelForCausalLM.from_config(cfg)
    graphshard.shard(model)
    tensors = [p.to_local() for p in model.parameters()] + list(model.buffers())
    devices = sorted({t.device.type for t in tensors})
    model.to_empty(device="cpu")
    return model, devices


def job_train(rank: int, world_size: int, mode: str, path: str, ways: tuple[str, ...]) -> dict:
    """Build, recompute the rotary buffers, then per way in ``ways``: load ``path`` that way
    and train ``STEPS`` steps with a fresh optimizer. A second way loads into the model the
    first one trained (and, compiled, reuses its graphs: one compile for both ways)."""
    model, devices = build_sharded(path)
    recomputed = graphshard.init_non_persistent_buffers(model)
    net = torch.compile(model, backend="graphshard") if mode == "compiled" else model
    results: dict = {}
    for way in ways:
        out: dict = {"recomputed": recomputed, "devices_before_to_empty": devices}
        out["loaded_keys"] = graphshard.load_safetensors(
            net, path, broadcast_from_rank0=way == "rank0"
        )
        out["loaded"] = params(model)
        out["buffers"] = buffers(model)
        out["tied"] = model.lm_head._parameters["weight"] is model.model.embed_tokens._parameters[
            "weight"]
        out["local_rows"] = {n: p.to_local().shape[0] for n, p in model.named_parameters()}
        out["losses"] = train(net, make_optimizer(net.parameters()), [rank])
        out["final"] = params(model)
        results[way] = out
    return results


def job_bad(rank: int, world_size: int, mode: str, path: str, other: str, way: str) -> dict:
    """Load ``path``, then try to load ``other`` (another config): the error, and the
    parameters and buffers before and after."""
    model, _ = build_sharded(path)
    graphshard.init_non_persistent_buffers(model)
    graphshard.load_safetensors(model, path, broadcast_from_rank0=way == "rank0")
    before = {**params(model), **buffers(model)}
    try:
        graphshard.load_safetensors(model, other, broadcast_from_rank0=way == "rank0")
        error = None
    except Exception as exc:  # noqa: BLE001  (the test checks type and message)
        error = (type(exc).__name__, str(exc))
    after = {**params(model), **buffers(model)}
    return {"error": error, "before": before, "after": after}


def job_unreadable(rank: int, world_size: int, mode: str, paths: tuple[str, ...],
                   way: str) -> dict:
    """Load ``paths[rank]``: a directory some ranks cannot read must make every rank raise
    (not leave the others waiting in a collective)."""
    model, _ = build_sharded(next(p for p in paths if os.path.isdir(p)))
    try:
        graphshard.load_safetensors(model, paths[rank], broadcast_from_rank0=way == "rank0")
        error = None
    except Exception as exc:  # noqa: BLE001  (the test checks type and message)
        error = (type(exc).__name__, str(exc))
    return {"error": error}


def job_export(rank: int, world_size: int, mode: str, path: str,
               outs: tuple[tuple[str, str], ...]) -> dict:
    """Load ``path``, train ``STEPS`` steps, then write a Hugging Face checkpoint each way
    of ``docs/large-models.md`` (``outs``: pairs of way and directory):

    - ``"save_pretrained"``: the full state dict on rank 0's host, written there by
      ``save_pretrained(state_dict=...)``;
    - ``"dcp"``: every rank writes its rows through DCP's ``HuggingFaceStorageWriter``,
      which consolidates them.

    The trained parameters are returned, to compare with what ``from_pretrained`` reads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    outs = dict(outs)
    model, _ = build_sharded(path)
    graphshard.init_non_persistent_buffers(model)
    net = torch.compile(model, backend="graphshard") if mode == "compiled" else model
    graphshard.load_safetensors(net, path)
    train(net, make_optimizer(net.parameters()), [rank])

    full_state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        model.save_pretrained(outs["save_pretrained"], state_dict=full_state)

    sharded_state = get_model_state_dict(model)
    if model.config.tie_word_embeddings:  # safetensors stores a shared tensor once
        del sharded_state["lm_head.weight"]
    dcp.save(sharded_state, storage_writer=dcp.HuggingFaceStorageWriter(
        outs["dcp"], save_distributed=True, enable_consolidation=True))
    if rank == 0:
        model.config.save_pretrained(outs["dcp"])
    dist.barrier()
    return {"final": params(model)}


JOBS: dict[str, Callable[..., dict]] = {
    "train": job_train, "bad": job_bad, "unreadable": job_unreadable, "export": job_export,
}


def run_jobs(rank: int, world_size: int, jobs: list[tuple]) -> dict:
    """Entry point of each rank: run every ``(job, mode, *args)`` in turn, keyed by the
    tuple itself. A job that raises records its traceback under ``"failed"``."""
    torch.manual_seed(0)
    counters = torch._dynamo.utils.counters
    results: dict = {}
    for job in jobs:
        name, mode, *args = job
        torch._dynamo.reset()
        graphs = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        try:
            results[job] = JOBS[name](rank, world_size, mode, *args)
        except Exception:  # noqa: BLE001
            results[job] = {"failed": traceback.format_exc()}
        results[job]["graphs"] = counters["stats"]["unique_graphs"] - graphs
        results[job]["seconds"] = time.perf_counter() - start
        dist.barrier()
    return results


# --------------------------------------------------------------------------- reference


def reference(path: str, world_size: int) -> dict:
    """``from_pretrained(path)``, the usual way, in one process: its parameters and
    buffers as loaded, then trained on every rank's batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    out: dict = {"loaded": params(model), "buffers": buffers(model)}
    out["tied"] = model.lm_head.weight is model.model.embed_tokens.weight
    out["losses"] = train(model, make_optimizer(model.parameters()), list(range(world_size)))
    out["final"] = params(model)
    return out
