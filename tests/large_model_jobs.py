"""Per-rank jobs of ``test_large_models``: the meta-device flow of a model too big for a rank.

Each job builds under ``torch.device("meta")``, shards (nothing allocated), ``to_empty``s
(each rank allocates its rows), then initialises or loads, the way FSDP2 users write it.
``run_jobs`` runs them all in one process-group launch per world size; a job that raises
records its traceback so one failure does not hide the others.
"""

from __future__ import annotations

import ctypes
import gc
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

import graphshard
from graphshard.models.llama import Llama, llama_config

SEED = 1234
STEPS = 3
MODES = ("eager", "compiled")
# torch's DTensor test Transformer at ~103 M parameters (~413 MB in float32)
BIG = ModelArgs(n_layers=8, vocab_size=1024, max_seq_len=64, dim=1024, n_heads=16,
                dropout_p=0.0, weight_tying=False)
SMALL = ModelArgs(n_layers=2, vocab_size=37, max_seq_len=16, dim=24, n_heads=4,
                  dropout_p=0.0, weight_tying=True)


# --------------------------------------------------------------------------- models and data


def tiny_llama(**overrides) -> Llama:
    """The shipped Llama, small; tied embeddings."""
    return Llama(llama_config("tiny", tie_embeddings=True, **overrides))


BUILDERS = {
    "llama": tiny_llama,
    "transformer": lambda: Transformer(SMALL),
    "big": lambda: Transformer(BIG),
}


def build(kind: str, seed: int = SEED) -> nn.Module:
    """The unsharded model ``kind`` initialised from ``seed`` (the reference)."""
    torch.manual_seed(seed)
    return BUILDERS[kind]()


def build_meta(kind: str) -> nn.Module:
    """``kind`` built under the meta device: shapes only."""
    with torch.device("meta"):
        return BUILDERS[kind]()


def initialise(model: nn.Module, seed: int = SEED) -> None:
    """The model's own initialisation from ``seed``: ``init_weights`` where the model has
    one, else every module's ``reset_parameters`` in ``modules()`` order (what construction
    does)."""
    torch.manual_seed(seed)
    if hasattr(model, "init_weights"):
        model.init_weights()
        return
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def tokens(kind: str, step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s token batch at ``step`` (2 sequences)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    vocab, seq = (256, 32) if kind == "llama" else (SMALL.vocab_size, SMALL.max_seq_len)
    return torch.randint(0, vocab, (2, seq), generator=gen)


def loss_of(kind: str, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``model`` on ``ids``."""
    if kind == "llama":
        return model(ids).loss
    logits = model(ids)
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def train(kind: str, model: nn.Module, steps: int, ranks: list[int]) -> list[float]:
    """``steps`` SGD-with-momentum steps on the batches of ``ranks`` (averaged); the losses.
    (Linear in the gradients: rounding differences of a compiled step stay small, where
    Adam's normalisation would blow up those of near-zero gradients.)"""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, foreach=True)
    losses = []
    for step in range(steps):
        loss = sum(loss_of(kind, model, tokens(kind, step, r)) for r in ranks) / len(ranks)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def full_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value (gathered from DTensors), by name."""
    return {
        name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for name, p in model.named_parameters()
    }


def buffers_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def maybe_compile(model: nn.Module, mode: str) -> nn.Module:
    return torch.compile(model, backend="graphshard") if mode == "compiled" else model


# --------------------------------------------------------------------------- memory


def _status(key: str) -> int:
    """A ``/proc/self/status`` entry in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _return_freed_memory() -> None:
    """Serve allocations of 1 MiB and more by mmap, so freed tensors leave the RSS at once
    (glibc's default threshold adapts upward, and then keeps freed transients in the heap:
    noise of the order of the largest parameter in a peak-RSS figure)."""
    m_mmap_threshold = -3
    ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 1 << 20)


def _settle() -> int:
    """Free what Python and malloc hold, reset the peak (VmHWM) to now; the RSS now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _local_bytes(model: nn.Module) -> int:
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


SYSTEMS = ("fsdp2", "graphshard")


def _fsdp2(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer)
    return fully_shard(model)


def _meta_flow(system: str, kind: str, full_sd: dict) -> nn.Module:
    """Meta build, shard (FSDP2: ``fully_shard`` per layer and root), ``to_empty``, then
    ``set_model_state_dict(broadcast_from_rank0=True)`` of rank 0's ``full_sd``."""
    model = build_meta(kind)
    _fsdp2(model) if system == "fsdp2" else graphshard.shard(model)
    model.to_empty(device="cpu")
    # a copy: torch's set_model_state_dict puts the loaded DTensors into the dict it gets
    set_model_state_dict(model, dict(full_sd), options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))
    return model


def job_memory(rank: int, world_size: int, ckpt_dir: str) -> dict:
    """Peak RSS growth (``VmHWM``) of the meta flow on the 413 MB Transformer, FSDP2 and
    graphshard in the same processes: meta build, shard, ``to_empty``,
    ``set_model_state_dict(broadcast_from_rank0=True)`` from rank 0's full state dict; then
    graphshard's ``dcp.load`` of a sharded checkpoint. A small model goes through each flow
    first, so one-time costs (imports, caches) are not charged to whichever runs first."""
    _return_freed_memory()
    small_sd = build("transformer").state_dict() if rank == 0 else {}
    for system in SYSTEMS:
        _meta_flow(system, "transformer", small_sd)
    full_sd = build("big").state_dict() if rank == 0 else {}
    sizes = [p.numel() * p.element_size() for p in build_meta("big").parameters()]
    out: dict = {"model_bytes": sum(sizes), "largest_param_bytes": max(sizes)}
    for system in SYSTEMS:
        base = _settle()
        model = build_meta("big")
        _fsdp2(model) if system == "fsdp2" else graphshard.shard(model)
        out[f"{system}_after_shard"] = _status("VmHWM") - base
        del model
        base = _settle()
        model = _meta_flow(system, "big", full_sd)
        out[f"{system}_growth"] = _status("VmHWM") - base
        out[f"{system}_local_bytes"] = _local_bytes(model)
        if system == "graphshard":
            out["loaded"] = _matches(model, full_sd, rank)
            dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)
        del model
    # every rank reads only its rows of a sharded checkpoint
    base = _settle()
    model = build_meta("big")
    graphshard.shard(model)
    model.to_empty(device="cpu")
    dcp.load(model.state_dict(), checkpoint_id=ckpt_dir)
    out["dcp_growth"] = _status("VmHWM") - base
    out["dcp_loaded"] = _matches(model, full_sd, rank)
    return out


def _matches(model: nn.Module, full_sd: dict, rank: int) -> bool | None:
    """On rank 0, whether every entry of the model's state equals ``full_sd`` (every rank
    takes part in the gathers)."""
    same = True
    for key, value in model.state_dict().items():
        gathered = value.full_tensor()
        if rank == 0:
            same = same and gathered.equal(full_sd[key])
    return same if rank == 0 else None


# --------------------------------------------------------------------------- init and load


def job_init(rank: int, world_size: int, kind: str) -> dict:
    """Meta build, shard, ``to_empty``, the model's own init from ``SEED``: full values."""
    model = build_meta(kind)
    graphshard.shard(model)
    model.to_empty(device="cpu")
    initialise(model)
    return {"params": full_values(model), "buffers": buffers_of(model)}


def _load_broadcast(model: nn.Module, kind: str, rank: int) -> None:
    full_sd = build(kind).state_dict() if rank == 0 else {}
    set_model_state_dict(model, full_sd, options=StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=True))


def job_train(rank: int, world_size: int, kind: str, hows: tuple[str, ...], mode: str,
              ckpt_dir: str) -> dict:
    """For each ``how`` in turn: meta build, shard, ``to_empty``, then initialise
    (``"init"``), load rank 0's full state dict by broadcast (``"broadcast"``; eager, it is
    then saved to ``ckpt_dir`` with ``dcp.save``) or the DCP checkpoint in ``ckpt_dir``
    (``"dcp"``); train ``STEPS`` SGD steps. Compiled, one model is built and compiled once
    and each ``how`` re-initialises or reloads it (a compile costs far more than a run)."""
    out: dict = {}
    model = run = None
    for how in hows:
        if run is None or mode == "eager":
            model = build_meta(kind)
            graphshard.shard(model)
            model.to_empty(device="cpu")
            run = maybe_compile(model, mode)
        if how == "init":
            initialise(model)
        elif how == "broadcast":
            _load_broadcast(model, kind, rank)
            if mode == "eager":
                dcp.save(model.state_dict(), checkpoint_id=ckpt_dir)
        else:
            dcp.load(model.state_dict(), checkpoint_id=ckpt_dir)
        losses = train(kind, run, STEPS, [rank])
        out[how] = {"losses": losses, "params": full_values(model)}
    return out


def job_bad_checkpoint(rank: int, world_size: int, ckpt_dir: str) -> dict:
    """``dcp.load`` of another model's checkpoint into the meta-built, initialised Llama:
    refused before anything is read, the model as it was."""
    model = build_meta("llama")
    graphshard.shard(model)
    model.to_empty(device="cpu")
    initialise(model)
    before = full_values(model)
    out: dict = {}
    try:
        dcp.load(model.state_dict(), checkpoint_id=ckpt_dir)
        out["dcp"] = "no error"
    except BaseException as exc:  # noqa: BLE001  (DCP's CheckpointException is a BaseException)
        out["dcp"] = f"{type(exc).__name__}: {exc}"
    out["dcp_untouched"] = all(v.equal(before[k]) for k, v in full_values(model).items())
    return out


def job_full_checkpoint(rank: int, world_size: int, good: str, bad: str) -> dict:
    """``graphshard.load_full_checkpoint`` of a ``torch.save``'d full state dict into the
    meta-built model; then of a deeper model's (every key of ours fits, plus more), which
    must be refused naming the extra keys with nothing written (torch's broadcast load
    would have written every tensor that fits before complaining)."""
    model = build_meta("llama")
    graphshard.shard(model)
    model.to_empty(device="cpu")
    out: dict = {"keys": graphshard.load_full_checkpoint(model, good)}
    out["params"] = before = full_values(model)
    try:
        graphshard.load_full_checkpoint(model, bad)
        out["bad"] = "no error"
    except Exception as exc:  # noqa: BLE001  (the test checks its type and text)
        out["bad"] = f"{type(exc).__name__}: {exc}"
    out["bad_untouched"] = all(v.equal(before[k]) for k, v in full_values(model).items())
    return out


JOBS = {
    "full_checkpoint": job_full_checkpoint,
    "memory": job_memory,
    "init": job_init,
    "train": job_train,
    "bad_checkpoint": job_bad_checkpoint,
}


def run_jobs(rank: int, world_size: int, jobs: list[tuple]) -> dict:
    """Entry point of each rank: run every ``(key, job, *args)`` in turn."""
    results: dict = {}
    for key, name, *args in jobs:
        torch._dynamo.reset()
        try:
            results[key] = JOBS[name](rank, world_size, *args)
        except BaseException:  # noqa: BLE001  (recorded: the test fails with it)
            results[key] = {"error": traceback.format_exc()}
        dist.barrier()
    return results


# --------------------------------------------------------------------------- references


def reference_train(kind: str, world_size: int, how: str) -> dict:
    """One process: the model built from ``SEED`` (and for ``how="init"`` initialised like
    the sharded one), trained on every rank's batches."""
    model = build(kind)
    if how == "init":
        initialise(model)
    losses = train(kind, model, STEPS, list(range(world_size)))
    return {"losses": losses, "params": full_values(model)}
