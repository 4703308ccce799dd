"""A small, readable Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU).

Written to trace with ``torch.compile(..., fullgraph=True)``: no data-dependent control flow,
no complex numbers (rotary embeddings use real arithmetic), and the rotary tables are
non-persistent buffers so they stay out of ``state_dict()`` and out of sharding.

Built under ``torch.device("meta")``, the model allocates nothing; ``to_empty(device=...)``
then leaves every tensor uninitialised. The rotary tables are not in any checkpoint, so
:class:`RotaryEmbedding` re-creates them itself when it leaves the meta device (and in
``reset_parameters()``); the weights come from :meth:`Llama.init_weights` or a checkpoint.

    cfg = llama_config("tiny")
    model = Llama(cfg)
    out = model(input_ids)          # LlamaOutput(loss, logits)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from graphshard.errors import GraphshardKeyError, GraphshardTypeError, GraphshardValueError

__all__ = [
    "LlamaConfig",
    "LlamaOutput",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "Attention",
    "FeedForward",
    "Block",
    "Llama",
    "CONFIGS",
    "llama_config",
    "llama_config_from_hf",
    "llama_name_from_hf",
    "tensor_parallel_plan",
    "check_tensor_parallel",
]

INIT_STD = 0.02


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and hyper-parameters of a :class:`Llama` model."""

    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 176
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise GraphshardValueError(
                f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            raise GraphshardValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if (self.dim // self.n_heads) % 2:
            raise GraphshardValueError(
                f"head_dim ({self.dim // self.n_heads}) must be even for RoPE"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class LlamaOutput(NamedTuple):
    """What :meth:`Llama.forward` returns."""

    loss: torch.Tensor
    logits: torch.Tensor


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """Precomputed rotary tables ``cos``/``sin`` of shape (max_seq_len, head_dim // 2)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        cos, sin = self._tables()
        device = torch.empty(0).device  # honours an enclosing torch.device(...) context
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    def _tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin, computed on the CPU in float32 (the same bits on every device)."""
        with torch.device("cpu"):
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
            inv_freq = 1.0 / (self.theta**exponents)
            angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32), inv_freq)
            return angles.cos(), angles.sin()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Recompute the tables in place (no-op on the meta device)."""
        if self.cos.is_meta:
            return
        cos, sin = self._tables()
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def _apply(self, fn, recurse: bool = True):
        # to_empty() (and .to() from meta) leaves the buffers uninitialised: re-create them.
        was_meta = self.cos.is_meta
        out = super()._apply(fn, recurse)
        if was_meta and not self.cos.is_meta:
            self.reset_parameters()
        return out

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.max_seq_len:
            raise GraphshardValueError(
                f"a sequence of {seq_len} tokens is longer than this Llama's max_seq_len "
                f"({self.max_seq_len}): cut the sequences, or build the model with "
                f"llama_config(..., max_seq_len={seq_len})")
        return self.cos[:seq_len], self.sin[:seq_len]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch, heads, seq, head_dim) by position: the "rotate half" layout.

    The first and second halves of the head dimension form the (real, imaginary) pairs.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    """Causal multi-head attention with grouped-query (GQA) key/value heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them
        q = self.wq(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seq_len, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeat = self.n_heads // self.n_kv_heads
        if repeat > 1:
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One pre-norm decoder layer: attention then feed-forward, each with a residual."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Token embeddings, ``n_layers`` blocks, a final norm and the output projection.

    Parameters are initialised in ``__init__`` from the global torch RNG (so the same
    ``torch.manual_seed`` gives the same model on every rank); :meth:`init_weights` with a
    seed re-initialises them from a private generator.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, 0.02) for linears and embeddings, ones for norms; the rotary tables
        recomputed.

        With ``seed`` the values come from a private generator seeded with it (the global
        RNG is untouched); without, from the global RNG. Meta tensors are left as they are.
        On sharded (DTensor) weights it gives the values the unsharded model would get.
        """
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        seen: set[int] = set()
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                weight = module.weight
                if id(weight) in seen or weight.is_meta:
                    continue
                seen.add(id(weight))
                if gen is None or weight.device.type == "cpu":
                    nn.init.normal_(weight, mean=0.0, std=INIT_STD, generator=gen)
                else:  # draw on the CPU generator, then copy, so every device agrees
                    values = torch.empty(weight.shape, dtype=weight.dtype)
                    nn.init.normal_(values, mean=0.0, std=INIT_STD, generator=gen)
                    if isinstance(weight, DTensor):  # this rank's part of the full values
                        values = distribute_tensor(
                            values.to(weight.device), weight.device_mesh, weight.placements,
                            src_data_rank=None,
                        )
                    weight.copy_(values)
            elif isinstance(module, RMSNorm) and not module.weight.is_meta:
                nn.init.ones_(module.weight)
            elif isinstance(module, RotaryEmbedding):
                module.reset_parameters()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> LlamaOutput:
        """Logits (batch, seq, vocab) and the mean cross-entropy loss.

        Without ``labels`` the loss is next-token prediction on ``input_ids`` itself (the
        logits at position t against token t + 1); with them, logits at every position
        against ``labels`` of the same shape (-100 is ignored).
        """
        seq_len = input_ids.shape[1]
        cos, sin = self.rope(seq_len)
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if labels is None:
            pred, target = logits[:, :-1], input_ids[:, 1:]
        else:
            pred, target = logits, labels
        loss = F.cross_entropy(
            pred.reshape(-1, pred.shape[-1]).float(), target.reshape(-1), ignore_index=-100
        )
        return LlamaOutput(loss, logits)

    def num_params(self) -> int:
        """Number of distinct parameter elements (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())


CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(
        vocab_size=256,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden=176,
        max_seq_len=64,
    ),
    "llama-small": LlamaConfig(
        vocab_size=2048,
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden=704,
        max_seq_len=256,
    ),
    "llama-medium": LlamaConfig(
        vocab_size=8192,
        dim=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden=1408,
        max_seq_len=512,
    ),
    # About 1.1B parameters: Llama 3.2 1B's body (dim 2048, 16 layers, 32 heads, 8 key/value
    # heads, SwiGLU 8192) with a 32k vocabulary and untied output: a model that fills a GPU.
    "llama-1b": LlamaConfig(
        vocab_size=32768,
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=8192,
        max_seq_len=4096,
        rope_theta=500000.0,
    ),
    "llama3-8b": LlamaConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": LlamaConfig(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}
# tiny's dimensions with llama-1b's 16 layers (147 parameter tensors): the per-parameter
# host cost of a GPU-sized model, measurable on a CPU, where its compute is small.
CONFIGS["tiny-deep"] = replace(CONFIGS["tiny"], n_layers=16)


def llama_config(name: str, **overrides) -> LlamaConfig:
    """The preset ``name`` from :data:`CONFIGS`, with any fields replaced by ``overrides``."""
    if name not in CONFIGS:
        raise GraphshardKeyError(f"Unknown Llama preset {name!r}; choose one of {sorted(CONFIGS)}")
    known = {f.name for f in fields(LlamaConfig)}
    unknown = set(overrides) - known
    if unknown:
        raise GraphshardTypeError(
            f"Unknown LlamaConfig fields {sorted(unknown)}; known: {sorted(known)}"
        )
    return replace(CONFIGS[name], **overrides)


# Hugging Face ``LlamaForCausalLM`` names -> this module's (the same architecture: RMSNorm,
# "rotate half" RoPE, GQA with each key/value head repeated in place, SwiGLU).
_HF_LAYER_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv",
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}
_HF_TOP_NAMES = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}


def llama_name_from_hf(name: str) -> str:
    """The :class:`Llama` parameter a Hugging Face Llama tensor name stands for
    (``model.layers.3.mlp.gate_proj.weight`` -> ``layers.3.feed_forward.w1.weight``);
    names it does not know are returned as they are (and then reported as unexpected)."""
    if name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"]:
        inner = ".".join(parts[3:-1])
        if inner in _HF_LAYER_NAMES:
            return f"layers.{parts[2]}.{_HF_LAYER_NAMES[inner]}.{parts[-1]}"
    return name


def llama_config_from_hf(hf_config: dict) -> LlamaConfig:
    """The :class:`LlamaConfig` of a Hugging Face Llama ``config.json`` (as a dict)."""
    heads = hf_config["num_attention_heads"]
    dim = hf_config["hidden_size"]
    if hf_config.get("head_dim", dim // heads) != dim // heads:
        raise GraphshardValueError(
            f"head_dim {hf_config['head_dim']} != hidden_size / num_attention_heads "
            f"({dim // heads}): this Llama derives the head size from dim and n_heads."
        )
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise GraphshardValueError(
            f"RoPE {rope} is not implemented by this Llama (plain RoPE only): load the "
            "model with transformers instead."
        )
    return LlamaConfig(
        vocab_size=hf_config["vocab_size"],
        dim=dim,
        n_layers=hf_config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf_config.get("num_key_value_heads") or heads,
        ffn_hidden=hf_config["intermediate_size"],
        max_seq_len=hf_config.get("max_position_embeddings", 2048),
        norm_eps=hf_config.get("rms_norm_eps", 1e-6),
        rope_theta=hf_config.get("rope_theta", rope.get("rope_theta", 10000.0)),
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
    )


def tensor_parallel_plan(model: Llama, *, sequence_parallel: bool = False) -> dict:
    """A ``parallelize_module`` plan for :class:`Llama` (Megatron style): attention heads and
    the FFN hidden dimension split across the TP ranks (q/k/v and w1/w3 column-wise, wo and
    w2 row-wise); embeddings, norms and the output replicated.

    With ``sequence_parallel`` (as torchtitan does it) the activations between the blocks
    are split along the sequence too: the norms run on 1/tp of the tokens
    (``SequenceParallel``), each block's input is gathered before attention and the FFN
    (``PrepareModuleInput``), wo and w2 reduce-scatter their outputs, and the embedding
    (vocab rows) and the output layer (vocab columns) are split across tp. Needs untied
    embeddings.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {}
    if sequence_parallel:
        if model.tok_embeddings.weight is model.output.weight:
            raise GraphshardValueError(
                "tensor_parallel_plan(sequence_parallel=True) splits the embedding by rows "
                "and the output layer by columns; a model with tied embeddings "
                "(tie_embeddings=True) takes the plan without sequence_parallel."
            )
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=Shard(1))
        plan["norm"] = SequenceParallel()
        plan["output"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    for i in range(len(model.layers)):
        for name in ("attention.wq", "attention.wk", "attention.wv",
                     "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = (RowwiseParallel(output_layouts=Shard(1))
                                          if sequence_parallel else RowwiseParallel())
        if sequence_parallel:
            for name in ("attention_norm", "ffn_norm"):
                plan[f"layers.{i}.{name}"] = SequenceParallel()
            plan[f"layers.{i}.attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None))
            plan[f"layers.{i}.feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def check_tensor_parallel(cfg: LlamaConfig, tp: int) -> None:
    """ValueError unless :func:`tensor_parallel_plan` splits ``cfg`` evenly over ``tp`` ranks:
    each rank needs whole query and key/value heads and an equal share of the FFN."""
    for what, size in (("n_heads", cfg.n_heads), ("n_kv_heads", cfg.n_kv_heads),
                       ("ffn_hidden", cfg.ffn_hidden)):
        if size % tp:
            raise GraphshardValueError(
                f"tensor parallelism over {tp} ranks splits the attention heads and the FFN: "
                f"{what} ({size}) must be divisible by tp"
            )
