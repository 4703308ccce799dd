"""Does graphshard train a Hugging Face architecture as one process does?

Each architecture (transformers' models, and diffusers' denoisers and autoencoder) is built
from a small config of its own (random weights, nothing downloaded), sharded with
``graphshard.shard``'s defaults on ``--world-size`` gloo ranks and trained for ``--steps``
AdamW steps, eagerly and compiled with graphshard's backend, every rank on batches of its
own. The same training in one process, on every rank's batches with
the ranks' losses averaged (the gradient the reduce-scatter averages), is the reference:
the table gives the largest relative difference of the rank-mean losses, the largest
absolute difference of the final state (every entry of the state dict, parameters gathered
whole) and a verdict against ``--rtol``/``--atol``.

AdamW's ``eps`` is raised to 1e-3: a gradient at round-off level (the bias of a
convolution before a batch norm, the query and key weights of an attention at init) would
otherwise get a full-size update whose sign the round-off picks, and one process and the
ranks round differently.

A transformers model's loss is its own (``labels`` in the batch); a diffusers model's is the
mean squared error of its ``sample`` against a random target of the same shape.

Usage (CPU, gloo; about a minute per architecture and mode on two cores)::

    python -m bench.architectures
    python -m bench.architectures --models gemma2 whisper --modes compiled --world-size 2
    python -m bench.architectures --models unet_text dit sd3 flux vae
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["ARCHITECTURES", "DIFFUSION_KINDS", "Architecture", "compare", "loss", "main",
           "train_ranks", "train_reference"]

VOCAB = 64
MODES = ("eager", "compiled")


@dataclass(frozen=True)
class Architecture:
    """A model to check: how to build it and what it exercises (the table's second column)."""

    build: Callable[[], Any]
    # transformers: "tokens" (labels: the ids), "seq2seq", "vision" or "speech";
    # diffusers (DIFFUSION_KINDS): "unet", "unet-text", "dit", "sd3", "flux" or "vae"
    kind: str
    exercises: str

    @property
    def library(self) -> str:
        """The package that defines the model."""
        return "diffusers" if self.kind in DIFFUSION_KINDS else "transformers"


DIFFUSION_KINDS = frozenset({"unet", "unet-text", "dit", "sd3", "flux", "vae"})


def _transformers() -> Any:
    import transformers

    return transformers


def _built(model: str, config: str, **options: Any) -> Callable[[], Any]:
    def build() -> Any:
        t = _transformers()
        return getattr(t, model)(getattr(t, config)(**options))

    return build


def _causal(config: str, model: str, **overrides: Any) -> Callable[[], Any]:
    """A decoder with the Llama-like configs' common small sizes, ``overrides`` on top."""
    return _built(model, config, **{
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
        "use_cache": False, **overrides})


def _diffusers(model: str, **options: Any) -> Callable[[], Any]:
    def build() -> Any:
        import diffusers

        built = getattr(diffusers, model)(**options)
        for module in built.modules():  # classifier-free guidance's random label drop: off
            if type(module).__name__ == "LabelEmbedding":
                module.dropout_prob = 0.0
        return built

    return build


_NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)

ARCHITECTURES: dict[str, Architecture] = {
    "t5": Architecture(_built(
        "T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32, d_kv=8,
        d_ff=64, num_layers=2, num_decoder_layers=1, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0), "seq2seq",
        "encoder-decoder, a position bias the first block passes on, cross-attention, "
        "one embedding tied three ways"),
    "mamba": Architecture(_built(
        "MambaForCausalLM", "MambaConfig", vocab_size=VOCAB, hidden_size=32, state_size=8,
        num_hidden_layers=3, expand=2, conv_kernel=4, use_cache=False), "tokens",
        "selective state-space blocks: a causal Conv1d, gates, a scan; no attention"),
    "gpt2": Architecture(_built(
        "GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
        n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1,
        eos_token_id=2, use_cache=False), "tokens",
        "Conv1D layers (transposed weights), learned positions, tied head"),
    "gpt_neox": Architecture(_causal(
        "GPTNeoXConfig", "GPTNeoXForCausalLM", rotary_pct=0.5, use_parallel_residual=True,
        **_NO_DROPOUT), "tokens", "parallel residual, rotary on half of each head"),
    "gemma2": Architecture(_causal(
        "Gemma2Config", "Gemma2ForCausalLM", num_key_value_heads=2, head_dim=8,
        sliding_window=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        attn_implementation="eager"), "tokens",
        "sliding-window and global layers in turn, logit soft-capping, tied head"),
    "phi3": Architecture(_causal(
        "Phi3Config", "Phi3ForCausalLM", num_key_value_heads=2, pad_token_id=0), "tokens",
        "fused QKV and gate-up projections"),
    "qwen2": Architecture(_causal(
        "Qwen2Config", "Qwen2ForCausalLM", num_key_value_heads=2, tie_word_embeddings=True),
        "tokens", "biased QKV, grouped-query attention, tied head"),
    "mixtral": Architecture(_causal(
        "MixtralConfig", "MixtralForCausalLM", num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2), "tokens", "mixture of experts: top-2 routing of 4 experts"),
    "opt": Architecture(_built(
        "OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
        word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, use_cache=False),
        "tokens", "learned offset positions, tied head"),
    "bloom": Architecture(_built(
        "BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=32, n_layer=2,
        n_head=4, use_cache=False, **_NO_DROPOUT), "tokens",
        "ALiBi position biases, an embedding layer norm"),
    "falcon": Architecture(_built(
        "FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=True,
        num_kv_heads=2, use_cache=False, **_NO_DROPOUT), "tokens",
        "parallel attention and MLP with two layer norms, grouped-query attention"),
    "gpt_bigcode": Architecture(_built(
        "GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=VOCAB, n_embd=32, n_layer=2,
        n_head=4, n_positions=64, multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False), "tokens", "multi-query attention"),
    "bert": Architecture(_built(
        "BertForMaskedLM", "BertConfig", vocab_size=VOCAB, hidden_size=32,
        num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0), "tokens",
        "bidirectional encoder, token-type embeddings, a tied masked-LM head"),
    "vit": Architecture(_built(
        "ViTForImageClassification", "ViTConfig", image_size=16, patch_size=4,
        num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, num_labels=5, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0), "vision",
        "a Conv2d patch embedding, a class token, a classifier"),
    "whisper": Architecture(_built(
        "WhisperForConditionalGeneration", "WhisperConfig", vocab_size=VOCAB, num_mel_bins=8,
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=8, max_target_positions=16, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, use_cache=False), "speech",
        "a Conv1d audio front end, fixed sinusoidal positions, encoder-decoder"),
    "qwen3": Architecture(_causal(
        "Qwen3Config", "Qwen3ForCausalLM", num_key_value_heads=2, head_dim=8), "tokens",
        "a norm on each head's queries and keys"),
    "qwen3_moe": Architecture(_causal(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "tokens",
        "experts stored as 3-D parameters (experts x rows x columns), top-2 routing"),
    "gemma3": Architecture(_causal(
        "Gemma3TextConfig", "Gemma3ForCausalLM", num_key_value_heads=2, head_dim=8,
        sliding_window=4, attn_implementation="eager"), "tokens",
        "local and global layers with rotary tables of their own, query and key norms"),
    "llama4": Architecture(_causal(
        "Llama4TextConfig", "Llama4ForCausalLM", num_hidden_layers=4, num_key_value_heads=2,
        head_dim=8, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=64,
        attention_chunk_size=4), "tokens",
        "a routed and a shared expert, chunked attention, layers without rotary"),
    "deepseek_v3": Architecture(_causal(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", num_hidden_layers=3,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, first_k_dense_replace=1, n_group=2, topk_group=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_shared_experts=1), "tokens",
        "multi-head latent attention, a dense first layer before the expert layers, "
        "grouped routing"),
    "gpt_oss": Architecture(_causal(
        "GptOssConfig", "GptOssForCausalLM", num_key_value_heads=2, head_dim=8,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        attn_implementation="eager"), "tokens",
        "attention sinks (a parameter per head), biased 3-D experts, sliding layers"),
    "olmo2": Architecture(_causal(
        "Olmo2Config", "Olmo2ForCausalLM", num_key_value_heads=2, pad_token_id=0,
        eos_token_id=2), "tokens", "norms after attention and MLP, query and key norms"),
    "mamba2": Architecture(_built(
        "Mamba2ForCausalLM", "Mamba2Config", vocab_size=VOCAB, hidden_size=32,
        num_hidden_layers=2, num_heads=4, head_dim=16, state_size=8, n_groups=1, expand=2,
        conv_kernel=4, chunk_size=4, use_cache=False), "tokens",
        "state-space duality: a chunked scan, gated RMS norm"),
    "qwen3_next": Architecture(_causal(
        "Qwen3NextConfig", "Qwen3NextForCausalLM", num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, full_attention_interval=2), "tokens",
        "gated delta-rule linear attention and full attention in turn (blocks that differ)"),
    "jamba": Architecture(_causal(
        "JambaConfig", "JambaForCausalLM", num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=4), "tokens",
        "Mamba and attention layers, dense and expert MLPs, in turn"),
    "lfm2": Architecture(_causal(
        "Lfm2Config", "Lfm2ForCausalLM", num_key_value_heads=2, block_ff_dim=64,
        layer_types=["conv", "full_attention"], conv_L_cache=3), "tokens",
        "gated short convolutions and attention in turn"),
    "modernbert": Architecture(_built(
        "ModernBertForMaskedLM", "ModernBertConfig", vocab_size=VOCAB, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
        "tokens", "local and global attention in turn, a GLU MLP, an encoder"),
    "unet": Architecture(_diffusers(
        "UNet2DModel", sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(16, 32), norm_num_groups=8,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"), attention_head_dim=8),
        "unet", "diffusers: a U-Net (convolutions, group norms, self-attention at one level, "
        "skip connections concatenated)"),
    "unet_text": Architecture(_diffusers(
        "UNet2DConditionModel", sample_size=8, in_channels=4, out_channels=4,
        layers_per_block=1, block_out_channels=(16, 32), norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=24,
        attention_head_dim=8),
        "unet-text", "diffusers: Stable Diffusion's U-Net (cross-attention to a text "
        "context, a nearest-neighbour upsampler)"),
    "dit": Architecture(_diffusers(
        "DiTTransformer2DModel", num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, num_layers=2, sample_size=8, patch_size=2, num_embeds_ada_norm=10,
        norm_num_groups=4),
        "dit", "diffusers: DiT (patches, adaptive layer norms from timestep and class)"),
    "sd3": Architecture(_diffusers(
        "SD3Transformer2DModel", sample_size=8, patch_size=2, in_channels=4, num_layers=2,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=24,
        caption_projection_dim=16, pooled_projection_dim=12, out_channels=4,
        pos_embed_max_size=16),
        "sd3", "diffusers: Stable Diffusion 3's MMDiT (joint attention over image and text "
        "streams)"),
    "flux": Architecture(_diffusers(
        "FluxTransformer2DModel", patch_size=1, in_channels=8, num_layers=1,
        num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=False,
        axes_dims_rope=(2, 2, 4)),
        "flux", "diffusers: Flux (double- and single-stream blocks, 3-axis rotary)"),
    "vae": Architecture(_diffusers(
        "AutoencoderKL", in_channels=3, out_channels=3, block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
        sample_size=8),
        "vae", "diffusers: a KL autoencoder (an encoder and a decoder, each with blocks "
        "of its own)"),
}


def build(name: str) -> Any:
    """Architecture ``name`` with seed 0's weights."""
    import torch

    torch.manual_seed(0)
    return ARCHITECTURES[name].build()


def batch(name: str, step: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s inputs (with labels) at ``step``: the same on every call."""
    import torch

    generator = torch.Generator().manual_seed(100 * step + rank)
    kind = ARCHITECTURES[name].kind
    if kind in DIFFUSION_KINDS:
        return _denoiser_batch(kind, generator)
    if kind == "vision":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=generator),
                "labels": torch.randint(0, 5, (2,), generator=generator)}
    if kind == "speech":
        return {"input_features": torch.randn(2, 8, 16, generator=generator),
                "labels": torch.randint(3, VOCAB, (2, 6), generator=generator)}
    ids = torch.randint(0, VOCAB, (2, 7), generator=generator)
    labels = ids.flip(1) if kind == "seq2seq" else ids  # a target sequence of its own
    return {"input_ids": ids, "labels": labels}


def _denoiser_batch(kind: str, generator: Any) -> dict[str, Any]:
    """A diffusers model's inputs, with ``"target"``: what its ``sample`` is compared with."""
    import torch

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=generator)

    timestep = torch.randint(0, 10, (2,), generator=generator)
    if kind == "flux":  # 16 tokens of 8 channels: a 4 x 4 latent, packed
        grid = torch.arange(16.0)
        return {"hidden_states": rand(2, 16, 8), "encoder_hidden_states": rand(2, 5, 24),
                "pooled_projections": rand(2, 12), "timestep": timestep.float() / 10,
                "img_ids": torch.stack([torch.zeros(16), grid // 4, grid % 4], dim=-1),
                "txt_ids": torch.zeros(5, 3), "target": rand(2, 16, 8)}
    if kind == "vae":
        return {"sample": rand(2, 3, 8, 8), "sample_posterior": False,
                "target": rand(2, 3, 8, 8)}
    channels = 3 if kind == "unet" else 4
    inputs = {"sample" if kind.startswith("unet") else "hidden_states":
              rand(2, channels, 8, 8), "timestep": timestep}
    if kind == "unet-text":
        inputs["encoder_hidden_states"] = rand(2, 5, 24)
    elif kind == "dit":
        inputs["class_labels"] = torch.randint(0, 10, (2,), generator=generator)
    elif kind == "sd3":
        inputs["encoder_hidden_states"] = rand(2, 5, 24)
        inputs["pooled_projections"] = rand(2, 12)
    inputs["target"] = rand(2, channels, 8, 8)
    return inputs


def loss(name: str, run: Any, step: int, rank: int) -> Any:
    """Rank ``rank``'s loss at ``step`` through ``run`` (the model, or it compiled)."""
    inputs = batch(name, step, rank)
    if "target" not in inputs:
        return run(**inputs).loss
    import torch

    target = inputs.pop("target")
    return torch.nn.functional.mse_loss(run(**inputs).sample, target)


def full_state(model: Any) -> dict[str, Any]:
    """The model's state dict with every sharded entry gathered whole (a collective)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def _train(model: Any, losses_at: Callable[[int], Any], steps: int) -> list[float]:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    losses = []
    for step in range(steps):
        loss = losses_at(step)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_ranks(rank: int, world_size: int, jobs: list[tuple[str, str]], steps: int) -> dict:
    """On each rank of a started process group: every ``(architecture, mode)`` job in turn,
    this rank's losses and the full state after ``steps`` steps; a job that raises records
    its traceback under ``"error"`` and the next job runs."""
    import torch

    import graphshard

    results: dict[Any, Any] = {}
    for name, mode in jobs:
        torch._dynamo.reset()
        try:
            model = graphshard.shard(build(name))
            run = model
            if mode == "compiled":
                run = torch.compile(model, backend=graphshard.backend())
            losses = _train(model, lambda step, run=run, name=name: loss(
                name, run, step, rank), steps)
            results[(name, mode)] = {"losses": losses, "state": full_state(model)}
        except Exception:  # noqa: BLE001  (reported in the table)
            results[(name, mode)] = {"error": traceback.format_exc()}
        if rank == 0:
            done = "raised" if "error" in results[(name, mode)] else "trained"
            print(f"[architectures] {name} {mode}: {done}", file=sys.stderr, flush=True)
    return results


def train_reference(name: str, world_size: int, steps: int) -> dict:
    """The unsharded model in this process, every rank's batches each step, their losses
    averaged."""
    model = build(name)

    def losses_at(step: int) -> Any:
        return sum(loss(name, model, step, r) for r in range(world_size)) / world_size

    return {"losses": _train(model, losses_at, steps), "state": full_state(model)}


def compare(per_rank: list[dict], reference: dict, rtol: float, atol: float) -> dict:
    """One row: the rank-mean losses' largest relative difference from the reference's, the
    final state's largest absolute difference, and whether both are within tolerance
    (``|a - b| <= atol + rtol * |b|`` everywhere, as ``torch.isclose``)."""
    import torch

    failed = next((r["error"] for r in per_rank if "error" in r), None)
    if failed is not None:
        return {"ok": False, "error": failed.strip().splitlines()[-1]}
    world = len(per_rank)
    mean = torch.tensor([sum(r["losses"][s] for r in per_rank) / world
                         for s in range(len(reference["losses"]))], dtype=torch.float64)
    want = torch.tensor(reference["losses"], dtype=torch.float64)
    loss_rel = float(((mean - want).abs() / want.abs()).max())
    ok = bool(torch.isclose(mean, want, rtol=rtol, atol=atol).all())
    state = per_rank[0]["state"]
    if state.keys() != reference["state"].keys():
        missing = sorted(reference["state"].keys() ^ state.keys())
        return {"ok": False, "loss_rel": loss_rel, "error": f"state keys differ: {missing}"}
    state_abs = 0.0
    for key, value in reference["state"].items():
        got = state[key].to(value.dtype)
        if value.numel():
            state_abs = max(state_abs, float((got - value).abs().max()))
        ok = ok and bool(torch.isclose(got, value, rtol=rtol, atol=atol).all())
    return {"ok": ok, "loss_rel": loss_rel, "state_abs": state_abs}


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows``: one line per architecture, a column per mode with the
    losses' largest relative and the state's largest absolute difference."""
    modes = list(dict.fromkeys(row["mode"] for row in rows))
    by_name: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_name.setdefault(row["architecture"], {})[row["mode"]] = row
    lines = ["| architecture | exercises | " + " | ".join(
        f"{mode}: losses / state" for mode in modes) + " | verdict |",
        "|---|---|" + "---:|" * len(modes) + "---|"]
    for name, cells in by_name.items():
        shown, verdicts = [], []
        for mode in modes:
            row = cells.get(mode)
            if row is None:
                shown.append("")
                continue
            if "loss_rel" in row and "state_abs" in row:
                shown.append(f"{row['loss_rel']:.1e} / {row['state_abs']:.1e}")
            else:
                shown.append("")
            if "error" in row:
                verdicts.append(f"{mode} failed: {row['error'][:200]}")
            elif not row["ok"]:
                verdicts.append(f"**{mode} differs**")
        verdict = "; ".join(verdicts) or "as one process"
        lines.append(f"| {name} | {ARCHITECTURES[name].exercises} | {' | '.join(shown)} "
                     f"| {verdict} |")
    return "\n".join(lines) + "\n"


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, jobs: list,
            steps: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=600))
    try:
        results = train_ranks(rank, world_size, jobs, steps)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.architectures",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(ARCHITECTURES),
                        default=list(ARCHITECTURES), metavar="NAME",
                        help=f"architectures to check (default: all of {', '.join(ARCHITECTURES)})")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps (default 3)")
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--atol", type=float, default=1e-6)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.steps < 1:
        parser.error("--world-size and --steps must be at least 1")
    for library in dict.fromkeys(ARCHITECTURES[name].library for name in args.models):
        if importlib.util.find_spec(library) is None:
            chosen = [name for name in args.models if ARCHITECTURES[name].library == library]
            parser.error(f"{', '.join(chosen)} need {library}: pip install {library}, or "
                         f"leave them out with --models")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Check the architectures: print the table, write ``--json`` where given, return the
    rows."""
    args = parse_args(argv)
    import torch
    import torch.multiprocessing as mp

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    jobs = [(name, mode) for name in args.models for mode in args.modes]
    with tempfile.TemporaryDirectory(prefix="architectures-") as tmp:
        mp.start_processes(_worker, args=(args.world_size, os.path.join(tmp, "store"), tmp,
                                          jobs, args.steps),
                           nprocs=args.world_size, join=True, start_method="spawn")
        per_rank = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False)
                    for r in range(args.world_size)]
    rows = []
    for name in args.models:
        reference = train_reference(name, args.world_size, args.steps)
        for mode in args.modes:
            row = compare([r[(name, mode)] for r in per_rank], reference, args.rtol, args.atol)
            rows.append({"architecture": name, "mode": mode, **row})
    text = table(rows)
    print(text, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if all(row["ok"] for row in main()) else 1)
