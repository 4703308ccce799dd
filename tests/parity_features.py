"""Parity cases for the training features: frozen and tied parameters, LoRA adapters (PEFT
on a Hugging Face Llama), gradient hooks, BatchNorm buffers, activation checkpointing,
eval/no_grad, graph breaks and shape changes.

Each case trains a tiny model on real gloo ranks (eager and compiled; the cases of
:data:`WITHOUT_INDUCTOR` compiled by graphshard's passes alone) and, in one process,
a reference that sees every rank's batch. Buffers are per rank as in DDP: the reference keeps
one copy of the buffers per rank and swaps it in for that rank's batch, so rank r's running
statistics are compared with the reference's copy r.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import full_state
from parity import LR, MOMENTUM, STEPS
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphshard
from graphshard.analysis.report import bucket_rows

EVAL_STEP = 2  # a forward-only step under model.eval() and torch.no_grad()


class Block(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 12, ckpt: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.ckpt = ckpt

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ckpt:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class Blocks(nn.Module):
    """Two blocks and a head: shard() makes buckets blocks.0, blocks.1 and the rest."""

    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(ckpt=ckpt), Block(ckpt=ckpt)])
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def frozen_mixed() -> nn.Module:
    """Bucket blocks.0 mixes a frozen Linear with a trainable one; head.bias is frozen too."""
    model = Blocks()
    model.blocks[0].up.requires_grad_(False)
    model.head.bias.requires_grad_(False)
    return model


class TiedAcross(nn.Module):
    """An embedding tied to the output head, the two users in different buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x), targets)


def frozen_tied() -> nn.Module:
    """The tied model with a bucket (blocks.0) that mixes frozen and trainable parameters."""
    model = TiedAcross()
    model.blocks[0].up.requires_grad_(False)
    return model


def tied_shard(model: nn.Module) -> None:
    # head's bucket owns the tied weight; the embedding that reads it is in the rest bucket.
    graphshard.shard(model, buckets=[model.head, model.blocks[0], model.blocks[1]])


class CheckpointTied(nn.Module):
    """Checkpointed code that reads a block's weights twice and the output head tied to the
    embedding outside it: several markers per shard (Dynamo's dedupe cannot see into the
    checkpoint body)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def _tail(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[1](self.blocks[1](x))
        return self.head(x)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.emb(tokens))
        x = checkpoint(F.linear, x, self.blocks[0].up.weight[:8], use_reentrant=False)
        logits = checkpoint(self._tail, x, use_reentrant=False)
        return F.cross_entropy(logits, targets)


HOOK_CLAMP = 2e-3  # below the largest entries of blocks.0.up's gradient: the clamp bites


def _halve_grad(param: torch.Tensor) -> None:
    param.grad.mul_(0.5)


def grad_hooks() -> nn.Module:
    """Gradient hooks registered before ``shard()``: a clamp (not linear in the gradient,
    so it must see the reduced gradient, as in one process) inside a block, a scale on the
    head and a post-accumulate-grad hook that halves a bias's gradient."""
    model = Blocks()
    model.blocks[0].up.weight.register_hook(lambda g: g.clamp(-HOOK_CLAMP, HOOK_CLAMP))
    model.head.weight.register_hook(lambda g: g * 2.0)
    model.blocks[1].down.bias.register_post_accumulate_grad_hook(_halve_grad)
    return model


class BatchNormNet(nn.Module):
    """BatchNorm between two Linears: running statistics are buffers, per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 10), nn.BatchNorm1d(10), nn.ReLU(), nn.Linear(10, 3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


class Breaks(Blocks):
    """A print and a data-dependent Python branch: three graphs per forward."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x)
        print("", end="")
        if x.mean() > 0:  # differs between ranks and steps
            x = x * 0.5
        else:
            x = x + 0.25
        x = self.blocks[1](x)
        return F.mse_loss(self.head(x), y)


def peft_lora() -> nn.Module:
    """PEFT's LoRA on a tiny Hugging Face Llama, as a fine-tuning script builds it: every
    base weight frozen, rank-4 adapters on the attention's q and v projections (initialised
    non-zero, so that both of each pair train from the first step)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=32, attn_implementation="sdpa",
                         use_cache=False)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                      init_lora_weights=False)
    return get_peft_model(LlamaForCausalLM(config), lora)


def save_adapters(model: nn.Module) -> dict:
    """PEFT's ``save_pretrained`` from the sharded model, rank 0 writing; the file as read back
    on every rank (keys as PEFT writes them, without the adapter's name)."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        directory = [tmp]
        dist.broadcast_object_list(directory, src=0)
        model.save_pretrained(directory[0], is_main_process=dist.get_rank() == 0)
        dist.barrier()
        saved = load_file(f"{directory[0]}/adapter_model.safetensors")
        dist.barrier()  # rank 0 removes its directory only once every rank has read it
    return {"saved_adapters": saved}


def _causal_lm_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    return model(input_ids=batch[0], labels=batch[0]).loss


def _lm_tokens(gen: torch.Generator, rows: int) -> tuple:
    return (torch.randint(0, 64, (rows, 12), generator=gen),)


def _regression(gen: torch.Generator, rows: int) -> tuple:
    return torch.randn(rows, 8, generator=gen), torch.randn(rows, 3, generator=gen)


def _tokens(gen: torch.Generator, rows: int) -> tuple:
    tokens, targets = (torch.randint(0, 16, (rows,), generator=gen) for _ in range(2))
    return tokens, targets


@dataclass(frozen=True)
class FeatureCase:
    """A model, its batches, how to shard it, and whether a step is forward-only."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator, int], tuple]
    rows: Callable[[int], int] = lambda step: 4
    shard: Callable[[nn.Module], object] = graphshard.shard
    eval_step: int | None = None
    # The forward-only step's grad mode: torch.no_grad, or torch.inference_mode (where the
    # gathered copies are inference tensors, with no version counter to check).
    eval_mode: Callable[[], object] = torch.no_grad
    # The loss of one batch (the model returns it, unless the case says otherwise).
    loss: Callable[[nn.Module, tuple], torch.Tensor] = lambda model, batch: model(*batch)
    # After training: what the user exports from the sharded model, into the rank's result.
    export: Callable[[nn.Module], dict] | None = None


CASES: dict[str, FeatureCase] = {
    "frozen_tied": FeatureCase(frozen_tied, _tokens, shard=tied_shard),
    "peft_lora": FeatureCase(peft_lora, _lm_tokens, loss=_causal_lm_loss, export=save_adapters),
    "grad_hooks": FeatureCase(grad_hooks, _regression),
    "batchnorm_eval": FeatureCase(BatchNormNet, _regression, eval_step=EVAL_STEP),
    "batchnorm_inference_mode": FeatureCase(BatchNormNet, _regression, eval_step=EVAL_STEP,
                                            eval_mode=torch.inference_mode),
    "checkpoint_tied": FeatureCase(CheckpointTied, _tokens),
    # Batch 4, then 6 (recompiles with a dynamic batch dimension), then 8 (reuses it).
    "breaks_reshape": FeatureCase(Breaks, _regression, rows=lambda step: (4, 4, 6, 6, 8)[step]),
}


def build(case: str) -> nn.Module:
    torch.manual_seed(4321)
    return CASES[case].build()


def batch(case: str, step: int, rank: int) -> tuple:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return CASES[case].batch(gen, CASES[case].rows(step))


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


# Compiled without Inductor: what they check (which parameters train, which gradients the
# hooks see, what the backward recomputes) is settled before Inductor, and each Inductor
# compile costs the suite about half a minute. BatchNorm's buffer updates and the shape
# changes go through Inductor.
WITHOUT_INDUCTOR = frozenset({"frozen_tied", "peft_lora", "grad_hooks", "checkpoint_tied"})


def train_sharded(rank: int, world_size: int, case: str, mode: str) -> dict:
    """Train ``case`` sharded, eager or compiled; losses are rank means, the eval step's
    loss is this rank's own."""
    torch._dynamo.reset()
    spec = CASES[case]
    model = build(case)
    spec.shard(model)
    backend = graphshard.backend(inductor=case not in WITHOUT_INDUCTOR)
    run = torch.compile(model, backend=backend) if mode == "compiled" else model
    opt = _optimizer(model)
    losses = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", graphshard.GraphBreakWarning)
        for step in range(STEPS):
            if step == spec.eval_step:
                model.eval()
                with spec.eval_mode():
                    losses.append(spec.loss(run, batch(case, step, rank)).item())
                model.train()
                continue
            loss = spec.loss(run, batch(case, step, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world_size)
    frozen_grads = [
        n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None
    ]
    return {
        "losses": losses,
        "state": full_state(model),
        "frozen_with_grad": frozen_grads,
        "break_warnings": [
            str(w.message) for w in caught if issubclass(w.category, graphshard.GraphBreakWarning)
        ],
        "graphs": len(backend.graphs),
        "reduced_params": _reduced_params(backend),
        **(spec.export(model) if spec.export else {}),
    }


def _reduced_params(backend: graphshard.GraphshardBackend) -> list[str]:
    """The parameters whose gradients the compiled backwards reduce-scatter (sorted)."""
    return sorted(
        name for stages in backend.graphs if "bw" in stages
        for row in bucket_rows(stages["bw"], backend.plan.profile)
        if row["kind"] in ("reduce_scatter", "all_to_all") for name in row["names"])


def train_reference(case: str, world_size: int) -> list[dict]:
    """One process on every rank's batch, buffers kept per rank; the result of each rank."""
    spec = CASES[case]
    model = build(case)
    opt = _optimizer(model)
    buffers = [{k: v.clone() for k, v in model.named_buffers()} for _ in range(world_size)]

    def on_rank(r: int, step: int) -> torch.Tensor:
        # Swap rank r's buffer tensors in (no copy: backward may still read the others).
        for key, tensor in buffers[r].items():
            owner, _, leaf = key.rpartition(".")
            model.get_submodule(owner)._buffers[leaf] = tensor
        return spec.loss(model, batch(case, step, r))

    losses: list[list[float]] = [[] for _ in range(world_size)]
    for step in range(STEPS):
        if step == spec.eval_step:
            model.eval()
            with spec.eval_mode():
                for r in range(world_size):
                    losses[r].append(on_rank(r, step).item())
            model.train()
            continue
        per_rank = [on_rank(r, step) for r in range(world_size)]
        loss = sum(per_rank) / world_size
        loss.backward()
        opt.step()
        opt.zero_grad()
        for r in range(world_size):
            losses[r].append(loss.item())
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # the state dict's buffers, rank r's own (not the non-persistent ones: a rotary table)
    buffers = [{k: v.detach().clone() for k, v in b.items() if k in params} for b in buffers]
    return [
        {"losses": losses[r], "state": {**params, **buffers[r]}} for r in range(world_size)
    ]


def run_jobs(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> dict:
    """Entry point for each rank: train every (case, mode) job in turn."""
    return {job: train_sharded(rank, world_size, *job) for job in jobs}
