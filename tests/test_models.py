"""Single-process tests of the reference models (no process group, no sharding)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from graphshard.models import CONFIGS, Llama, LlamaConfig, LlamaOutput, OddMLP, llama_config
from graphshard.models.llama import apply_rotary


def tiny(**overrides) -> Llama:
    torch.manual_seed(0)
    return Llama(llama_config("tiny", **overrides))


def meta_param_count(name: str) -> int:
    with torch.device("meta"):
        model = Llama(llama_config(name))
    return sum(p.numel() for p in model.parameters())


def test_forward_shapes_and_loss():
    model = tiny()
    cfg = model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (3, 17))
    out = model(tokens)
    assert isinstance(out, LlamaOutput)
    assert out.logits.shape == (3, 17, cfg.vocab_size)
    assert out.loss.dim() == 0 and torch.isfinite(out.loss)
    # A freshly initialised model guesses close to uniformly.
    assert abs(out.loss.item() - math.log(cfg.vocab_size)) < 0.5
    out.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_loss_with_and_without_labels():
    model = tiny()
    tokens = torch.randint(0, 256, (2, 12))
    shifted = model(tokens).loss
    labels = torch.full_like(tokens, -100)
    labels[:, :-1] = tokens[:, 1:]
    assert torch.allclose(model(tokens, labels).loss, shifted)


def test_causal():
    model = tiny()
    tokens = torch.randint(0, 256, (1, 10))
    changed = tokens.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 256
    a, b = model(tokens).logits, model(changed).logits
    assert torch.allclose(a[:, :6], b[:, :6], atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_a_sequence_longer_than_max_seq_len_names_the_fix():
    """The rotary tables hold max_seq_len positions: a longer sequence failed deep in
    apply_rotary ("Attempting to broadcast a dimension of length 64")."""
    model = Llama(llama_config("tiny"))
    model(torch.zeros(1, 64, dtype=torch.long))
    with pytest.raises(ValueError, match=r"65 tokens .* max_seq_len \(64\).*max_seq_len=65"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_rotary_preserves_norm_and_position_zero():
    model = tiny()
    cos, sin = model.rope(5)
    x = torch.randn(2, 3, 5, model.cfg.head_dim)
    y = apply_rotary(x, cos, sin)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    assert torch.equal(y[:, :, 0], x[:, :, 0])
    assert "rope.cos" not in model.state_dict()


def test_tied_embeddings_share_one_parameter():
    model = tiny(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    names = [name for name, _ in model.named_parameters()]
    assert "output.weight" not in names  # listed once, under its first name
    untied = tiny(tie_embeddings=False)
    assert untied.output.weight is not untied.tok_embeddings.weight
    assert untied.num_params() - model.num_params() == 256 * 64


def test_init_is_deterministic():
    a, b = tiny(), tiny()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    for module in a.modules():
        if isinstance(module, nn.Linear | nn.Embedding):
            assert abs(module.weight.std().item() - 0.02) < 0.005
    norms = [p for n, p in a.named_parameters() if "norm" in n]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    a.init_weights(seed=7)
    b.init_weights(seed=7)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("tie", [False, True])
def test_fullgraph_compile_has_no_graph_break(tie):
    torch._dynamo.reset()
    model = tiny(tie_embeddings=tie)
    tokens = torch.randint(0, 256, (2, 16))
    explanation = torch._dynamo.explain(model)(tokens)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(tokens)
    out.loss.backward()
    assert torch.allclose(out.loss, model(tokens).loss, atol=1e-5)


@pytest.mark.parametrize(("name", "expected"), [("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9)])
def test_preset_parameter_counts(name, expected):
    count = meta_param_count(name)
    assert abs(count - expected) / expected < 0.01, f"{name}: {count / 1e9:.3f}B"


def test_presets_and_overrides():
    assert set(CONFIGS) >= {"tiny", "llama-small", "llama-medium", "llama3-8b", "llama3-70b"}
    cfg = llama_config("tiny", n_layers=3, tie_embeddings=True)
    assert (cfg.n_layers, cfg.tie_embeddings, cfg.dim) == (3, True, 64)
    assert CONFIGS["tiny"].n_layers == 2  # the preset itself is untouched
    assert llama_config("llama3-8b").rope_theta == 500000.0
    with pytest.raises(KeyError):
        llama_config("gpt-5")
    with pytest.raises(TypeError):
        llama_config("tiny", width=3)
    with pytest.raises(ValueError):
        LlamaConfig(dim=64, n_heads=4, n_kv_heads=3)


def test_odd_mlp():
    torch.manual_seed(0)
    model = OddMLP()
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(13, 29), (29, 7), (7, 3)]
    x, y = torch.randn(5, 13), torch.randn(5, 3)
    out = model(x, y)
    assert out.output.shape == (5, 3)
    assert torch.allclose(out.loss, torch.nn.functional.mse_loss(out.output, y))
    out.loss.backward()
    assert model(x).loss is None
