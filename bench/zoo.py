"""The models ``bench.architectures`` trains: each built from a small config of its own
(random weights, nothing downloaded), with a batch per step and rank and a loss.

- transformers' models: their own loss (``labels`` in the batch);
- diffusers' denoisers and autoencoder: the mean squared error of ``sample`` against a random
  target of the same shape;
- torchvision's and timm's image classifiers: the cross-entropy of their logits against random
  labels. Their batch norms keep statistics per rank (as in DDP), which the reference follows.

Dropout and stochastic depth are off (in the configs; in torchvision's modules after they are
built; timm's are off by default), so that no process draws anything random.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ARCHITECTURES", "DIFFUSION_KINDS", "Architecture", "batch", "build",
           "enable_gradient_checkpointing", "loss"]

VOCAB = 64
CLASSES = 10
# torchvision's batches: 4 pictures of 64 x 64. Smaller ones leave a batch norm of the last
# stage a few values per channel, and the training amplifies round-off without bound: at 2 of
# 32 x 32, ResNet trained in one process on 1 thread and on 2 differs by 2e-2 after 3 steps.
# EfficientNet, RegNet, ShuffleNet and SqueezeNet are left out: at any size tried (up to 4 of
# 128 x 128) the same one-process training on 1 and on 2 threads differs beyond --rtol and
# --atol, so that no distributed run could be told from one process by this check. timm's
# Hiera is left out too: its max pools (amax over tokens) meet near-ties (gaps of 6e-7 by the third
# step), where a round-off flips which token takes the gradient; on torch 2.11 its own
# training under plain torch.compile departs from eager by 4e-3 in state after 3 steps.
PICTURE = 64


@dataclass(frozen=True)
class Architecture:
    """A model to check: how to build it and what it exercises (the table's second column)."""

    build: Callable[[], Any]
    # transformers: "tokens" (labels: the ids), "seq2seq", "vision" or "speech";
    # diffusers (DIFFUSION_KINDS): "unet", "unet-text", "dit", "sd3", "flux" or "vae";
    # torchvision: "image" (a classifier of PICTURE x PICTURE pictures into CLASSES classes);
    # timm: "timm" (the same pictures and classes)
    kind: str
    exercises: str

    @property
    def library(self) -> str:
        """The package that defines the model."""
        if self.kind in DIFFUSION_KINDS:
            return "diffusers"
        return {"image": "torchvision", "timm": "timm"}.get(self.kind, "transformers")


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


def _torchvision(build_model: Callable[[Any], Any]) -> Callable[[], Any]:
    """``build_model(torchvision.models)``, with its dropout and stochastic depth off."""
    def build() -> Any:
        import torch
        from torchvision import models, ops

        built = build_model(models)
        for module in built.modules():
            if isinstance(module, (torch.nn.modules.dropout._DropoutNd, ops.StochasticDepth)):
                module.p = 0.0
        return built

    return build


def _timm(build_model: Callable[[Any], Any]) -> Callable[[], Any]:
    """``build_model(timm)`` (dropout and stochastic depth left at timm's default of off)."""
    def build() -> Any:
        import timm  # imports timm.models

        return build_model(timm)

    return build


_TIMM_VIT = dict(pretrained=False, num_classes=CLASSES, img_size=PICTURE, depth=2, embed_dim=64,
                 num_heads=2)
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
    "resnet": Architecture(_torchvision(lambda m: m.ResNet(
        m.resnet.BasicBlock, [1, 1, 1, 1], num_classes=CLASSES)), "image",
        "torchvision: ResNet (batch norms, a max pool, strided shortcuts)"),
    "densenet": Architecture(_torchvision(lambda m: m.DenseNet(
        growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16, bn_size=2,
        num_classes=CLASSES)), "image",
        "torchvision: DenseNet (every layer's input the concatenation of those before)"),
    "mobilenet_v3": Architecture(_torchvision(lambda m: m.mobilenet_v3_small(
        num_classes=CLASSES, width_mult=0.25)), "image",
        "torchvision: MobileNetV3 (depthwise convolutions, squeeze-excitation, hard-swish)"),
    "convnext": Architecture(_torchvision(lambda m: m.ConvNeXt(
        [m.convnext.CNBlockConfig(16, 32, 1), m.convnext.CNBlockConfig(32, None, 1)],
        num_classes=CLASSES)), "image",
        "torchvision: ConvNeXt (7 x 7 depthwise convolutions, channel-last layer norms, "
        "layer scale)"),
    "swin": Architecture(_torchvision(lambda m: m.SwinTransformer(
        [4, 4], 16, [2, 2], [2, 4], [2, 2], stochastic_depth_prob=0.0,
        num_classes=CLASSES)), "image",
        "torchvision: Swin (shifted windows, relative position bias tables, patch merging)"),
    "swin_v2": Architecture(_torchvision(lambda m: m.SwinTransformer(
        [4, 4], 16, [2, 2], [2, 4], [2, 2], stochastic_depth_prob=0.0,
        num_classes=CLASSES, block=m.swin_transformer.SwinTransformerBlockV2,
        downsample_layer=m.swin_transformer.PatchMergingV2)), "image",
        "torchvision: Swin V2 (cosine attention, a continuous position bias MLP)"),
    "vit_tv": Architecture(_torchvision(lambda m: m.VisionTransformer(
        image_size=PICTURE, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=CLASSES)), "image",
        "torchvision: ViT (a class token, nn.MultiheadAttention)"),
    "maxvit": Architecture(_torchvision(lambda m: m.MaxVit(
        input_size=(PICTURE, PICTURE), stem_channels=8, partition_size=2, block_channels=[16, 32],
        block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0,
        num_classes=CLASSES)), "image",
        "torchvision: MaxViT (MBConv, block and grid attention)"),
    "eva02": Architecture(_timm(lambda t: t.create_model("eva02_tiny_patch14_224", **_TIMM_VIT)),
                          "timm", "timm: EVA-02 (2-D rotary, SwiGLU with a norm inside)"),
    "beit": Architecture(_timm(lambda t: t.create_model("beit_base_patch16_224", **_TIMM_VIT)),
                         "timm", "timm: BEiT (a relative position bias per block, layer scale)"),
    "cait": Architecture(_timm(lambda t: t.create_model("cait_xxs24_224", **_TIMM_VIT)),
                         "timm", "timm: CaiT (talking heads, class attention after the blocks)"),
    "convnextv2": Architecture(_timm(lambda t: t.models.convnext.ConvNeXt(
        depths=(1, 1, 1, 1), dims=(16, 32, 64, 128), use_grn=True, ls_init_value=None,
        num_classes=CLASSES)), "timm", "timm: ConvNeXt V2 (global response normalization)"),
    "nfnet": Architecture(_timm(lambda t: t.models.nfnet.NormFreeNet(t.models.nfnet.NfCfg(
        depths=(1, 1, 1, 1), channels=(32, 64, 96, 128), stem_type="deep_quad", stem_chs=16,
        group_size=16, extra_conv=True, gamma_in_act=True, same_padding=True, skipinit=True,
        num_features=256, act_layer="gelu", attn_layer="se", attn_kwargs={"rd_ratio": 0.5}),
        num_classes=CLASSES)), "timm",
        "timm: NFNet (no norms: weight-standardized convolutions, zero-initialized skip gains)"),
    "mixer": Architecture(_timm(lambda t: t.models.mlp_mixer.MlpMixer(
        num_classes=CLASSES, img_size=PICTURE, patch_size=16, num_blocks=2, embed_dim=64)),
        "timm", "timm: MLP-Mixer (token-mixing MLPs across patches, no attention)"),
}


def build(name: str) -> Any:
    """Architecture ``name`` with seed 0's weights."""
    import torch

    torch.manual_seed(0)
    return ARCHITECTURES[name].build()


def enable_gradient_checkpointing(model: Any) -> None:
    """Turn on ``model``'s own activation checkpointing, as its library's users do:
    transformers' ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``
    before 5.x; non-reentrant) or diffusers' ``enable_gradient_checkpointing``
    (non-reentrant by default) or timm's ``set_grad_checkpointing`` (non-reentrant by
    default). Raises ``ValueError`` for a model without one (torchvision's, and the few the
    libraries mark unsupported)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "gradient_checkpointing_enable"):  # transformers 4
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(model, "enable_gradient_checkpointing"):  # diffusers
        model.enable_gradient_checkpointing()
    elif hasattr(model, "set_grad_checkpointing"):  # timm (non-reentrant by default)
        model.set_grad_checkpointing(True)
    else:
        raise ValueError(f"{type(model).__name__} has no activation checkpointing of its own")
    model.train()  # both libraries checkpoint only in training mode


def batch(name: str, step: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s inputs (with labels) at ``step``: the same on every call."""
    import torch

    generator = torch.Generator().manual_seed(100 * step + rank)
    kind = ARCHITECTURES[name].kind
    if kind in DIFFUSION_KINDS:
        return _denoiser_batch(kind, generator)
    if kind in ("image", "timm"):
        return {"pixels": torch.randn(4, 3, PICTURE, PICTURE, generator=generator),
                "target": torch.randint(0, CLASSES, (4,), generator=generator)}
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
    if ARCHITECTURES[name].kind in ("image", "timm"):
        return torch.nn.functional.cross_entropy(run(inputs["pixels"]), target)
    return torch.nn.functional.mse_loss(run(**inputs).sample, target)
