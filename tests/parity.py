"""Training-parity harness: sharded training on N gloo ranks vs one process on all ranks' data.

The reference runs every rank's local batch in one process and averages the losses, so its
gradient is the average that the reduce-scatter computes. SGD with momentum keeps round-off
from being magnified the way Adam does for parameters whose true gradient is zero.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from dist_utils import full_state
from torch import nn
from torch._functorch import config as functorch_config
from torch._inductor import config as inductor_config
from torch._inductor.utils import run_and_get_code

import graphshard
from graphshard.models.llama import Llama, llama_config
from graphshard.models.mlp import MLPOutput, OddMLP
from graphshard.passes.markers import is_collective_start

STEPS = 5
LR, MOMENTUM = 0.05, 0.9


def _loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(*batch).loss


@dataclass(frozen=True)
class Case:
    """A model, how to draw its batch for (step, rank), and how to get its loss."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple]
    loss: Callable[[nn.Module, tuple], torch.Tensor] = _loss


def _tokens(gen: torch.Generator) -> tuple:
    return (torch.randint(0, 256, (2, 16), generator=gen),)


def _tokens_and_labels(gen: torch.Generator) -> tuple:
    tokens = torch.randint(0, 256, (2, 16), generator=gen)
    return tokens, tokens


def _regression(gen: torch.Generator) -> tuple:
    return torch.randn(6, 13, generator=gen), torch.randn(6, 3, generator=gen)


def _hf_gpt2() -> nn.Module:
    """Hugging Face GPT-2 (tied wte/lm_head, Conv1D layers), tiny, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0, attn_implementation="sdpa",
                     use_cache=False)  # training, as docs/large-models.md says
    return GPT2LMHeadModel(cfg)


def _hf_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


class _OneRank:
    """What PyTorch's test model reads from its group argument at construction."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


def _torch_transformer() -> nn.Module:
    """PyTorch's own FSDP test model: nn.Transformer, shared embedding/output, BatchNorm,
    buffers (eval mode: deterministic, no dropout)."""
    from torch.testing._internal.common_fsdp import DEVICEInitMode, TransformerWithSharedParams

    return TransformerWithSharedParams(_OneRank(), DEVICEInitMode.DEVICE_NEVER, True, True)


def _src_tgt(gen: torch.Generator) -> tuple:
    return torch.randint(0, 23, (6, 2), generator=gen), torch.randint(0, 23, (4, 2), generator=gen)


def _seq2seq_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    logits = model(*batch)
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), batch[1].view(-1))


class OddParams(nn.Module):
    """Shapes that need padding: a 0-D scale, dim 0 of 1 and 2 (below the world size), 3-D."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.shift = nn.Parameter(torch.randn(1))
        self.mix = nn.Parameter(torch.randn(2, 5, 3) * 0.3)
        self.proj = nn.Linear(6, 5)

    def forward(self, x, y):
        h = torch.einsum("bi,kij->bkj", self.proj(x), self.mix).flatten(1)
        out = self.scale * torch.tanh(h) + self.shift
        return MLPOutput(torch.nn.functional.mse_loss(out, y), out)


def _odd_batch(gen: torch.Generator) -> tuple:
    return torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)


class ConvHead(nn.Module):
    """A strided convolution with a bias (a ViT's patch embedding) under a linear head: on
    torch 2.11 Inductor could not lower the convolution of a gathered bias."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, 8, kernel_size=4, stride=4)
        self.head = nn.Linear(8 * 16, 5)

    def forward(self, x, y):
        out = self.head(self.patches(x).flatten(1))
        return MLPOutput(torch.nn.functional.mse_loss(out, y), out)


def _images(gen: torch.Generator) -> tuple:
    return torch.randn(2, 3, 16, 16, generator=gen), torch.randn(2, 5, generator=gen)


CASES: dict[str, Case] = {
    "llama_tied": Case(lambda: Llama(llama_config("tiny", tie_embeddings=True)), _tokens),
    "llama_untied": Case(lambda: Llama(llama_config("tiny", tie_embeddings=False)), _tokens),
    # the loss against labels: with region bodies that donate their inputs (torch's bug:
    # graphshard/safety/region_donation.py), flat gathers and coalesced reduce-scatters
    # gave the first block wrong gradients here
    "llama_untied_labels": Case(lambda: Llama(llama_config("tiny", tie_embeddings=False)),
                                _tokens_and_labels),
    "mlp_odd": Case(lambda: OddMLP(), _regression),
    "hf_gpt2": Case(_hf_gpt2, _tokens, _hf_loss),
    "torch_transformer": Case(_torch_transformer, _src_tgt, _seq2seq_loss),
    "odd_params": Case(OddParams, _odd_batch),
    "conv_bias": Case(ConvHead, _images),
}


def build(case: str) -> nn.Module:
    torch.manual_seed(1234)
    return CASES[case].build()


def batch(case: str, step: int, rank: int) -> tuple:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return CASES[case].batch(gen)


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


# Backend variants the compiled path must match the reference under (name -> options).
VARIANTS: dict[str, dict] = {
    "default": {},
    "depth0": {"prefetch_depth": 0},
    "depth2": {"prefetch_depth": 2},
    "size": {"bucketing": "size", "bucket_bytes": 600},
    "auto": {"bucketing": "auto"},
    "auto_capped": {"bucketing": "auto", "prefetch_depth": 2, "max_unsharded_bytes": 200_000},
    # gloo's own reduce-scatter (an all-reduce in disguise) instead of the all-to-all
    "rs_collective": {"reduce_scatter_via": "reduce_scatter"},
    # each bucket gathered and reduced by coalesced collectives: no copy into or out of a
    # flat buffer
    "coalesced": {"all_gather_via": "coalesced", "reduce_scatter_via": "coalesced"},
    # flat gathers, coalesced reduce-scatters
    "coalesced_rs": {"reduce_scatter_via": "coalesced"},
}


# torch._inductor.config.cpp_wrapper on and every block compiled inline (a compile region
# is beyond torch's C++ wrapper): the forward, gathers included, is wrapped in C++; the
# backward, whose gloo all-to-alls the wrapper cannot call, keeps the Python wrapper and says
# so. Inductor's caches are off, so every graph is generated (and its source read) here.
CPP_WRAPPER = "cpp_wrapper"


def train_sharded(rank: int, world_size: int, case: str, mode: str, variant: str = "default"):
    """Train ``case`` sharded (``mode`` = "eager", "compiled" with backend ``variant``, or
    "lowered": the same, graphshard's transformed graphs run without Inductor); losses are
    rank means."""
    if variant != CPP_WRAPPER:
        return _train_sharded(rank, world_size, case, mode, variant)
    with functorch_config.patch(enable_autograd_cache=False), \
            inductor_config.patch(fx_graph_cache=False, cpp_wrapper=True), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, code = run_and_get_code(_train_sharded, rank, world_size, case, mode, "default",
                                        compile_blocks_once=False)
    result["cpp_wrapped"] = ["inductor_entry_impl" in source for source in code]
    result["wrapper_warnings"] = [str(w.message) for w in caught
                                  if issubclass(w.category, graphshard.PythonWrapperWarning)]
    return result


def _train_sharded(rank: int, world_size: int, case: str, mode: str, variant: str,
                   **shard_options) -> dict:
    torch._dynamo.reset()
    model = graphshard.shard(build(case), **shard_options)
    backend = graphshard.backend(**VARIANTS[variant], inductor=mode != "lowered")
    run = model if mode == "eager" else torch.compile(model, backend=backend)
    opt = _optimizer(model)
    losses = []
    for step in range(STEPS):
        loss = CASES[case].loss(run, batch(case, step, rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    collectives = {stage: sorted(  # one entry per collective of every graph compiled
        str(node.target) for stages in backend.graphs if stage in stages
        for node in stages[stage].graph.nodes if is_collective_start(node))
        for stage in ("fw", "bw")}
    return {"losses": losses, "state": full_state(model), "bw_collectives": collectives["bw"],
            "fw_collectives": collectives["fw"]}


def train_reference(case: str, world_size: int) -> dict:
    """The single-process reference: every rank's batch, losses averaged."""
    model = build(case)
    opt = _optimizer(model)
    losses = []
    for step in range(STEPS):
        per_rank = [CASES[case].loss(model, batch(case, step, r)) for r in range(world_size)]
        loss = sum(per_rank) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.detach() for k, v in model.state_dict().items()}}


def run_jobs(rank: int, world_size: int, jobs: list[tuple]) -> dict:
    """Entry point for each rank: train every (case, mode[, variant]) job in turn."""
    return {job: train_sharded(rank, world_size, *job) for job in jobs}


def assert_matches(result: dict, reference: dict, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Losses and every full state-dict entry agree to ``rtol`` relative."""
    torch.testing.assert_close(
        torch.tensor(result["losses"], dtype=torch.float64),
        torch.tensor(reference["losses"], dtype=torch.float64),
        rtol=rtol,
        atol=0.0,
    )
    assert result["state"].keys() == reference["state"].keys()
    for key, value in reference["state"].items():
        torch.testing.assert_close(result["state"][key], value, rtol=rtol, atol=atol, msg=key)
