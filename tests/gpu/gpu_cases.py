"""The CUDA tier's cases, each a function of a :class:`~gpu_harness.World` (and a mode,
"eager" or "compiled"): it builds and shards the model, trains it ``STEPS`` steps and
checks the losses and parameters against one process (``gpu_harness.reference``).

``tests/gpu/test_gpu_*.py`` run them on the GPU, at NCCL world 1 and in the CUDA fake world
of 8; ``tests/test_gpu_tier_cpu.py`` runs most of them eagerly on the CPU (gloo world 1 and
the CPU fake world), which proves the cases and their references right where no GPU is.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from gpu_harness import (
    INIT_SEED,
    OFFLOAD,
    STEPS,
    TINY,
    Job,
    Outcome,
    World,
    check,
    llama_job,
    local,
    make_optimizer,
    peak_memory,
    reference,
    shard_job,
    snapshot,
    train,
    warm_up,
)
from torch import nn

import graphshard
from graphshard.api import grad_norm_ops, step_prefetch
from graphshard.models.llama import Llama, tensor_parallel_plan


def _what(world: World, mode: str, *parts: str) -> str:
    return " ".join((world.name, mode, *parts))


# --------------------------------------------------------------------------- training


def case_precision(world: World, mode: str, precision: str) -> None:
    """fp32, or ``graphshard.MixedPrecision`` bf16 (fp32 reductions) or fp16 (fp16
    reductions, divided before the sum)."""
    job = llama_job()
    out = train(world, shard_job(world, job, precision), job, mode)
    ref = reference(job, world.device, precision=precision, shapes=out.local_shapes)
    check(out, ref, precision, _what(world, mode, precision))


def case_no_sync(world: World, mode: str, micro: int = 2) -> None:
    """``micro`` micro-batches per step, all but the last under ``graphshard.no_sync``: one
    reduction of the summed gradients per step."""
    job = llama_job()
    out = train(world, shard_job(world, job), job, mode, micro=micro)
    ref = reference(job, world.device, micro=micro, shapes=out.local_shapes)
    check(out, ref, "fp32", _what(world, mode, "no_sync"))


def case_gradient_divide_factor(world: World, mode: str, replicas: int = 1) -> None:
    """``shard(gradient_divide_factor=1.0)`` (torchtitan's setting): the ranks' gradients
    summed, each rank's loss divided by the world size first, so the update is the
    reference's average again; on ``replicas`` x world / replicas the sum spans both."""
    job = llama_job()
    scaled = Job(job.build, job.batch, lambda model, batch: job.loss(model, batch) / world.size)
    mesh = (None if replicas == 1
            else world.mesh((replicas, world.size // replicas), ("replicate", "shard")))
    out = train(world, shard_job(world, scaled, mesh=mesh, gradient_divide_factor=1.0),
                scaled, mode)
    out.losses = [loss * world.size for loss in out.losses]
    ref = reference(job, world.device, shapes=out.local_shapes)
    check(out, ref, "fp32", _what(world, mode, f"gradient_divide_factor {replicas} replicas"))


def case_hsdp(world: World, mode: str, replicas: int = 2) -> None:
    """HSDP: a (replicate, shard) mesh, ``replicas`` x world / replicas."""
    mesh = world.mesh((replicas, world.size // replicas), ("replicate", "shard"))
    job = llama_job()
    out = train(world, shard_job(world, job, mesh=mesh), job, mode)
    ref = reference(job, world.device, shapes=out.local_shapes)
    check(out, ref, "fp32", _what(world, mode, f"hsdp {replicas}x{world.size // replicas}"))


def case_tensor_parallel(world: World, mode: str, tp: int = 2) -> None:
    """torch's ``parallelize_module`` with the Llama's Megatron plan over tp, then
    ``graphshard.shard`` over dp: a (dp, tp) mesh of world / tp x tp."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = world.mesh((world.size // tp, tp), ("dp", "tp"))
    job = llama_job()
    model = job.build().to(world.device)
    parallelize_module(model, mesh["tp"], tensor_parallel_plan(model))
    graphshard.shard(model, mesh["dp"])
    out = train(world, model, job, mode)
    ref = reference(job, world.device, shapes=out.local_shapes)
    check(out, ref, "fp32", _what(world, mode, f"dp{world.size // tp} x tp{tp}"))


def checkpointed_llama(cfg) -> Llama:
    """The Llama with every block wrapped by torch's ``checkpoint_wrapper`` (non-reentrant
    activation checkpointing: the backward recomputes each block's forward)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Llama(cfg)
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)
    return model


def case_activation_checkpointing(world: World, mode: str, block_regions: bool = True) -> None:
    """Every block checkpointed; the reference is the same checkpointed model unsharded
    (recomputation does not change the numbers). ``block_regions=False``
    (``compile_blocks_once=False``): the step is one graph, whose recomputed random ops
    torch's own partitioner functionalizes (on CUDA with generator inputs of the graph),
    where the block regions' partitioner does it without them."""
    job = llama_job(cls=checkpointed_llama)
    model = shard_job(world, job, compile_blocks_once=block_regions)
    assert sum(type(m).__name__ == "CheckpointWrapper" for m in model.modules()) == TINY.n_layers
    out = train(world, model, job, mode)
    ref = reference(job, world.device, shapes=out.local_shapes)
    check(out, ref, "fp32", _what(world, mode, "activation checkpointing"
                                  + ("" if block_regions else ", one graph")))


def case_clip_grad_norm(world: World, mode: str) -> None:
    """After every backward, torch's ``clip_grad_norm_`` (a threshold that scales) with
    graphshard's local norms (:mod:`graphshard.api.grad_norm_ops`), ``graphshard.clip_grad_norm_``
    on a copy of the gradients, and torch's through DTensor's dispatch on another: the same
    total norm and gradients, bit for bit, on the device; the local norms serve every step
    after the first. Training then goes on with the clipped gradients. (Earlier cases'
    models are collected first: a sharded model found garbage makes the local path forget
    what it remembered, and the collection would otherwise come when it pleases.)"""
    gc.collect()
    job = llama_job()
    served: list[int] = []  # norms wrapped by the local path, per step
    wrap = grad_norm_ops.wrap_local

    def clip_both_ways(model: nn.Module) -> None:
        params = [p for p in model.parameters() if p.grad is not None]
        saved = [p.grad.detach().clone() for p in params]
        wrapped: list[int] = []
        grad_norm_ops.wrap_local = lambda norm, spec: wrapped.append(1) or wrap(norm, spec)
        try:
            total = torch.nn.utils.clip_grad_norm_(params, 0.05)
        finally:
            grad_norm_ops.wrap_local = wrap
        served.append(len(wrapped))
        clipped = [p.grad for p in params]
        for p, grad in zip(params, saved, strict=True):
            p.grad = grad.clone()
        ours = graphshard.clip_grad_norm_(params, 0.05)
        ours_clipped = [p.grad for p in params]
        for p, grad in zip(params, saved, strict=True):
            p.grad = grad
        with grad_norm_ops.dtensor_dispatch():
            expected = torch.nn.utils.clip_grad_norm_(params, 0.05)
        for how, got, got_grads in (("torch's", total, clipped),
                                    ("graphshard's", ours, ours_clipped)):
            what = _what(world, mode, how, "clip_grad_norm_")
            assert torch.equal(local(got), local(expected)), what
            assert got.placements == expected.placements, what
            for mine, theirs in zip(got_grads, (p.grad for p in params), strict=True):
                assert mine.placements == theirs.placements, what
                assert torch.equal(local(mine), local(theirs)), what

    model = shard_job(world, job)
    train(world, model, job, mode, after_backward=clip_both_ways)
    count = len(list(model.parameters()))
    assert served == [0] + [count] * (STEPS - 1), served


def case_step_prefetch(world: World) -> None:
    """Backend option ``step_prefetch=True``: ``optimizer.step()`` gathers the next forward's
    first buckets, which the forward takes (in a world of more than one rank)."""
    job = llama_job()
    step_prefetch.reset_stats()
    out = train(world, shard_job(world, job), job, "compiled",
                backend_options={"step_prefetch": True})
    stats = step_prefetch.stats()
    ref = reference(job, world.device, shapes=out.local_shapes)
    check(out, ref, "fp32", _what(world, "compiled", "step_prefetch", str(stats)))
    if world.size > 1:  # at world 1 there is no gather to prefetch
        assert stats["split_steps"] == STEPS, stats
        assert stats["taken"] > 0 and stats["stale"] == 0, stats


def case_coalesced(world: World, precision: str) -> None:
    """Backend options ``all_gather_via="coalesced"`` and ``reduce_scatter_via="coalesced"``:
    every bucket gathered and reduced by coalesced collectives (one NCCL group each), the
    parameters views of the gathered outputs and the shards' gradients of the reduced ones."""
    job = llama_job()
    out = train(world, shard_job(world, job, precision), job, "compiled",
                backend_options={"all_gather_via": "coalesced",
                                 "reduce_scatter_via": "coalesced"})
    ref = reference(job, world.device, precision=precision, shapes=out.local_shapes)
    check(out, ref, precision, _what(world, "compiled", "coalesced", precision))


def case_compile_mode(world: World) -> None:
    """``torch.compile``'s ``mode`` through the backend (``mode="max-autotune-no-cudagraphs"``:
    Inductor autotunes the step's kernels, forward and backward) trains like one process; a
    mode that records CUDA graphs raises on the GPU, naming the mode without them."""
    import pytest

    from graphshard.errors import GraphshardNotImplementedError

    job = llama_job()
    out = train(world, shard_job(world, job), job, "compiled",
                backend_options={"mode": "max-autotune-no-cudagraphs"})
    ref = reference(job, world.device, shapes=out.local_shapes)
    check(out, ref, "fp32", _what(world, "compiled", "max-autotune-no-cudagraphs"))
    with pytest.raises(Exception, match="max-autotune-no-cudagraphs") as raised:
        train(world, shard_job(world, job), job, "compiled",
              backend_options={"mode": "max-autotune"})
    cause = raised.value  # Dynamo's BackendCompilerFailed holds it as inner_exception
    while cause is not None and not isinstance(cause, GraphshardNotImplementedError):
        cause = getattr(cause, "inner_exception", None) or cause.__cause__
    assert cause is not None, repr(raised.value)


def case_cpp_wrapper(world: World, precision: str) -> None:
    """``torch._inductor.config.cpp_wrapper`` (``graphshard/compiler/wrapper_choice.py``):
    with the blocks compiled inline, graphs whose operations torch's C++ wrapper can call are
    wrapped in C++ (NCCL's collectives included) and train like one process; with the default
    compile regions the graphs keep the Python wrapper and a warning says why."""
    import warnings

    from torch._inductor import config as inductor_config

    job = llama_job()
    for blocks_once in (False, True):
        with inductor_config.patch(cpp_wrapper=True), \
                warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = train(world, shard_job(world, job, precision, compile_blocks_once=blocks_once),
                        job, "compiled")
        ref = reference(job, world.device, precision=precision, shapes=out.local_shapes)
        check(out, ref, precision, _what(world, "compiled", "cpp_wrapper", precision))
        said = [str(w.message) for w in caught
                if issubclass(w.category, graphshard.PythonWrapperWarning)]
        if blocks_once:
            assert any("compile_blocks_once=False" in s for s in said), said
        else:
            assert not any("compile region" in s for s in said), said


# --------------------------------------------------------------------------- building, loading


def _buffers_match(model: nn.Module, want: nn.Module, device: torch.device, what: str,
                   rtol: float = 0.0) -> None:
    """Every buffer of ``model`` on ``device``'s type and equal to ``want``'s (within
    ``rtol``: a buffer computed on the GPU may differ from the CPU's in the last bit)."""
    wrong = {n: str(b.device) for n, b in model.named_buffers() if b.device.type != device.type}
    assert not wrong, (
        f"{what}: buffers not on {device.type}: {wrong} (graphshard.shard onto a "
        f"{device.type} mesh, CPU offload and to_empty(device='cpu') included, must leave "
        "the buffers on the mesh's device: the forward computes there)"
    )
    expected = dict(want.named_buffers())
    assert {n for n, _ in model.named_buffers()} == expected.keys(), what
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf.cpu(), expected[name].cpu(), rtol=rtol, atol=0,
                                   msg=lambda m, n=name: f"{what} buffer {n}: {m}")


def case_meta_init(world: World, mode: str, how: str) -> None:
    """docs/large-models.md's flow: build on the meta device, shard (allocating nothing),
    ``to_empty`` on the device, then ``how``: "init" (``init_weights(seed)``, the values the
    unsharded model gets) or "broadcast" (rank 0's full state dict through
    ``set_model_state_dict(..., broadcast_from_rank0=True)``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    job = llama_job(init_seed=INIT_SEED if how == "init" else None)
    with torch.device("meta"):
        model = Llama(TINY)
    graphshard.shard(model, world.mesh())
    assert all(local(p).is_meta for p in model.parameters())
    model.to_empty(device=world.device)
    if how == "init":
        model.init_weights(seed=INIT_SEED)
    elif how == "broadcast":
        full = job.build().state_dict()
        set_model_state_dict(model, full if dist.get_rank() == 0 else {}, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
    else:
        raise ValueError(f"how {how!r}: 'init' or 'broadcast'")
    _buffers_match(model, job.build(), world.device, _what(world, mode, "meta", how))
    out = train(world, model, job, mode)
    ref = reference(job, world.device, shapes=out.local_shapes)
    check(out, ref, "fp32", _what(world, mode, "meta", how))


def _optimizer_locals(state: dict) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": local(value).detach().cpu()
            for name, entry in state["state"].items() for key, value in entry.items()
            if isinstance(value, torch.Tensor)}


def case_dcp(world: World, mode: str, path: str) -> None:
    """Train ``STEPS - 1`` steps, ``dcp.save`` the model's and the optimizer's state, load
    it with ``dcp.load`` into a model and optimizer of other values (exactly), train the
    last step there: the losses and parameters of ``STEPS`` uninterrupted steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    what = _what(world, mode, "dcp")
    job = llama_job()
    model = shard_job(world, job)
    opt = make_optimizer(model)
    first = train(world, model, job, mode, opt=opt, steps=range(STEPS - 1))
    saved_opt = get_optimizer_state_dict(model, opt)
    dcp.save({"model": model.state_dict(), "optim": saved_opt}, checkpoint_id=path)

    fresh = shard_job(world, llama_job(init_seed=INIT_SEED))  # other values: the load replaces
    fresh_opt = make_optimizer(fresh)
    state = {"model": fresh.state_dict(), "optim": get_optimizer_state_dict(fresh, fresh_opt)}
    dcp.load(state, checkpoint_id=path)
    fresh.load_state_dict(state["model"])
    set_optimizer_state_dict(fresh, fresh_opt, state["optim"])
    for name, value in snapshot(model).items():
        torch.testing.assert_close(snapshot(fresh)[name], value, rtol=0, atol=0,
                                   msg=lambda m, n=name: f"{what} loaded {n}: {m}")
    want = _optimizer_locals(saved_opt)
    got = _optimizer_locals(get_optimizer_state_dict(fresh, fresh_opt))
    assert got.keys() == want.keys() and want, what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0,
                                   msg=lambda m, k=key: f"{what} optimizer {k}: {m}")

    last = train(world, fresh, job, mode, opt=fresh_opt, steps=range(STEPS - 1, STEPS))
    out = Outcome(first.losses + last.losses, first.initial, last.final, last.local_shapes)
    check(out, reference(job, world.device, shapes=out.local_shapes), "fp32", what)


def hf_job(path: str) -> Job:
    """``AutoModelForCausalLM.from_pretrained(path)`` (a ``save_pretrained`` directory of
    ``hf_jobs.save_random``) on ``hf_jobs``' token batches, with its own causal LM loss."""
    import hf_jobs

    def build() -> nn.Module:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path)

    return Job(build, lambda step, micro: (hf_jobs.batch(step, micro),),
               lambda model, batch: hf_jobs.loss_fn(model, batch[0]))


def case_hf_llama(world: World, mode: str, path: str, way: str) -> None:
    """The Hugging Face flow of docs/large-models.md: ``from_config`` on the meta device,
    shard, ``to_empty`` on the device, ``init_non_persistent_buffers``, ``load_safetensors``
    (``way``: "per_rank", each rank reads its rows; "rank0", rank 0 reads and broadcasts), against
    ``from_pretrained`` in one process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    what = _what(world, mode, "hf llama", way)
    job = hf_job(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    graphshard.shard(model, world.mesh())
    model.to_empty(device=world.device)
    graphshard.init_non_persistent_buffers(model)
    graphshard.load_safetensors(model, path, broadcast_from_rank0=way == "rank0")
    plain = job.build()
    if plain.config.tie_word_embeddings:
        assert (model.lm_head._parameters["weight"]
                is model.model.embed_tokens._parameters["weight"]), what
    # inv_freq is recomputed on the device by the model's own _init_weights
    _buffers_match(model, plain, world.device, what, rtol=1e-6)
    out = train(world, model, job, mode)
    check(out, reference(job, world.device, shapes=out.local_shapes), "fp32", what)


# --------------------------------------------------------------------------- CPU offload


def _offloaded(world: World, recipe: str) -> nn.Module:
    """The offload job's model sharded with ``CPUOffload`` on the world's (accelerator)
    mesh. ``recipe`` "cpu": built on the CPU and sharded, nothing moved by hand; "meta":
    built on the meta device, sharded, ``to_empty(device="cpu")``, ``init_weights``."""
    offload = graphshard.CPUOffload()
    if recipe == "cpu":
        return graphshard.shard(offload_job().build(), world.mesh(), offload=offload)
    if recipe == "meta":
        with torch.device("meta"):
            model = Llama(OFFLOAD)
        graphshard.shard(model, world.mesh(), offload=offload)
        model.to_empty(device="cpu")
        model.init_weights(seed=INIT_SEED)
        return model
    raise ValueError(f"recipe {recipe!r}: 'cpu' or 'meta'")


def offload_job() -> Job:
    """The bigger Llama (:data:`gpu_harness.OFFLOAD`), initialised by
    ``init_weights(seed=INIT_SEED)`` (so a meta-built model gets the same values)."""
    return llama_job(OFFLOAD, init_seed=INIT_SEED)


def _grads_on_host(model: nn.Module) -> None:
    wrong = {n: str(local(p.grad).device) for n, p in model.named_parameters()
             if p.grad is None or local(p.grad).device.type != "cpu"}
    assert not wrong, f"gradients not on the host after backward: {wrong}"


def case_offload_copy_streams(world: World, options: dict[str, bool]) -> None:
    """Compiled ``CPUOffload`` with the copies on streams of their own (``options``:
    ``backend(grad_copy_stream=True)``, the gradients to the host, waited for once per
    graph; ``shard_copy_stream=True``, the shards to the device a bucket ahead, each waited
    for by an event): every step computes bit for bit what the default (every copy on the
    compute stream) computes, and within tolerance what one process does. Needs a CUDA
    world."""
    what = _what(world, "compiled", "offload", *sorted(options))
    job = offload_job()
    warm_up(world.device)
    model = _offloaded(world, "cpu")
    default = train(world, model, job, "compiled", after_backward=_grads_on_host)
    del model
    model = _offloaded(world, "cpu")
    out = train(world, model, job, "compiled", backend_options=options,
                after_backward=_grads_on_host)
    del model
    assert out.losses == default.losses, f"{what}: losses {out.losses} != {default.losses}"
    for name, got in out.final.items():
        assert torch.equal(got, default.final[name]), f"{what}: final {name} differs"
    check(out, reference(job, world.device), "fp32", what)


def case_offload(world: World, mode: str, recipe: str) -> None:
    """``CPUOffload`` (recipe: see :func:`_offloaded`) trains like one process and like the
    run without offload, with the shards, gradients and optimizer state on the host and
    the device's peak memory (``torch.cuda.max_memory_allocated``) below that run's by at
    least half the model's fp32 bytes. Needs a CUDA world."""
    what = _what(world, mode, "offload", recipe)
    job = offload_job()
    device = world.device
    warm_up(device)
    with peak_memory(device) as plain:
        model = shard_job(world, job)
        plain_out = train(world, model, job, mode)
        del model
    with peak_memory(device) as offloaded:
        model = _offloaded(world, recipe)
        shards = {n: local(p) for n, p in model.named_parameters()}
        assert all(t.device.type == "cpu" for t in shards.values()), what
        if recipe == "cpu":  # (to_empty gives the meta recipe's rows unpinned)
            unpinned = [n for n, t in shards.items() if not t.is_pinned()]
            assert not unpinned, f"{what}: host shards not pinned: {unpinned}"
        _buffers_match(model, job.build(), device, what)
        out = train(world, model, job, mode, after_backward=_grads_on_host)
        del model, shards
    ref = reference(job, device)
    check(plain_out, ref, "fp32", _what(world, mode, "no offload"))
    check(out, ref, "fp32", what)
    model_bytes = sum(t.numel() * t.element_size() for t in ref.final.values())
    assert offloaded["peak"] < plain["peak"] - model_bytes // 2, (
        f"{what}: peak device memory {offloaded['peak'] / 2**20:.1f} MiB with offload, "
        f"{plain['peak'] / 2**20:.1f} MiB without (model {model_bytes / 2**20:.1f} MiB)"
    )
