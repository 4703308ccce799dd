"""Rank jobs of ``test_hf_architectures``: Hugging Face models unlike Llama, built from small
configs, sharded with the defaults and trained eagerly and compiled, against one process.

- T5 (encoder-decoder): two block lists (each layer of both a bucket of its own), a
  relative position bias computed by the encoder's first block and
  passed to the second, cross-attention, embeddings tied across encoder, decoder and head;
- Mamba: selective state-space blocks (a causal ``Conv1d``, ``SiLU`` gates, a scan), no
  attention.

(GPT-2 trained as exactly in a probe on 2026-12-02 and is left out: its compile adds about
23 s to the suite for a structure close to Llama's.)

Each rank trains on its own rows; the reference averages the ranks' losses in one process,
the gradient the reduce-scatter averages.
"""

from __future__ import annotations

import os
import traceback

import torch
from torch.distributed.tensor import DTensor

import graphshard

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODES = ("eager", "compiled")
STEPS = 3
VOCAB = 64


def t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1,
        num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))


def mamba() -> torch.nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=3, expand=2,
        conv_kernel=4, use_cache=False))


MODELS = {"t5": t5, "mamba": mamba}


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def tokens(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s token ids at ``step``."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, VOCAB, (2, 7), generator=generator)


def loss_of(name: str, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    labels = ids.flip(1) if name == "t5" else ids  # T5: a target sequence of its own
    return model(input_ids=ids, labels=labels).loss


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


def train(model: torch.nn.Module, run, losses_at) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(STEPS):
        loss = losses_at(step, run)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def run_jobs(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> dict:
    """Every ``(model, mode)`` in turn; a job that raises records its traceback."""
    results = {}
    for name, mode in jobs:
        torch._dynamo.reset()
        try:
            model = graphshard.shard(build(name))
            run = model
            if mode == "compiled":
                run = torch.compile(model, backend=graphshard.backend())
            losses = train(model, run, lambda step, run, name=name: loss_of(
                name, run, tokens(step, rank)))
            results[(name, mode)] = {"losses": losses, "state": full_state(model)}
        except Exception:  # noqa: BLE001  (the test fails with it)
            results[(name, mode)] = {"error": traceback.format_exc()}
    return results


def reference(name: str, world_size: int) -> dict:
    """The plain model, every rank's rows each step, the ranks' losses averaged."""
    model = build(name)

    def losses_at(step: int, run) -> torch.Tensor:
        return sum(loss_of(name, run, tokens(step, r)) for r in range(world_size)) / world_size

    losses = train(model, model, losses_at)
    return {"losses": losses, "state": full_state(model)}
