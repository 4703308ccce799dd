"""Rank jobs of ``test_training_loops``: training loops as users write them, against the same
loop in one process.

Two sharded models in one step (``job_two_models``):

- ``gan``: a generator and a discriminator, each sharded and (in "compiled" mode) compiled on
  its own, each with its own Adam. The discriminator's loss runs it twice (real rows, then the
  generator's output detached) before one backward; the generator's loss backpropagates
  through the discriminator, whose shards then get gradients its optimizer never steps
  (``zero_grad`` drops them), as in every GAN loop.
- ``distill``: a frozen teacher in ``eval()`` under ``torch.no_grad()`` and a student trained
  on the KL divergence to it; both sharded.

Blocks compiled one by one (``job_block_compile``), as torchtitan and FSDP2 users compile:
a Hugging Face Llama sharded whole, then each decoder layer compiled on its own
(``layer.compile(backend="graphshard")``) while the embedding, the final norm and the output
layer run eagerly.

Every rank draws its own rows; the reference runs all ranks' rows in one batch, which gives
the same means (every rank holds as many rows).
"""

from __future__ import annotations

import contextlib
import time
import traceback
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import graphshard

MODES = ("eager", "compiled")
STEPS = 4
ROWS = 4


def build() -> dict[str, nn.Module]:
    """The four models, from seed 0: generator, discriminator, teacher, student. Odd widths,
    so that no world divides every dimension."""
    torch.manual_seed(0)
    models = {
        "gen": nn.Sequential(nn.Linear(8, 33), nn.ReLU(), nn.Linear(33, 16)),
        "disc": nn.Sequential(nn.Linear(16, 31), nn.LeakyReLU(0.2), nn.Linear(31, 1)),
        "teacher": nn.Sequential(nn.Linear(16, 47), nn.GELU(), nn.Linear(47, 10)),
        "student": nn.Sequential(nn.Linear(16, 23), nn.GELU(), nn.Linear(23, 10)),
    }
    models["teacher"].requires_grad_(False).eval()
    return models


def optimizers(models: dict[str, nn.Module]) -> dict[str, torch.optim.Optimizer]:
    """One optimizer per trained model: Adam for the GAN (as usual), SGD with momentum for
    the student."""
    return {
        "gen": torch.optim.Adam(models["gen"].parameters(), lr=1e-2, betas=(0.5, 0.9)),
        "disc": torch.optim.Adam(models["disc"].parameters(), lr=1e-2, betas=(0.5, 0.9)),
        "student": torch.optim.SGD(models["student"].parameters(), lr=0.5, momentum=0.9),
    }


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (noise, real rows) at ``step``, the same in every process."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(ROWS, 8, generator=gen), torch.randn(ROWS, 16, generator=gen)


def gan_step(gen: nn.Module, disc: nn.Module, opts: dict, noise: torch.Tensor,
             real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One discriminator step, then one generator step (non-saturating loss)."""
    fake = gen(noise)
    d_loss = F.softplus(-disc(real)).mean() + F.softplus(disc(fake.detach())).mean()
    d_loss.backward()
    opts["disc"].step()
    opts["disc"].zero_grad()
    g_loss = F.softplus(-disc(gen(noise))).mean()
    g_loss.backward()
    opts["gen"].step()
    opts["gen"].zero_grad()
    opts["disc"].zero_grad()  # the generator's loss gave the discriminator gradients too
    return d_loss.detach(), g_loss.detach()


def distill_step(teacher: nn.Module, student: nn.Module, opts: dict,
                 rows: torch.Tensor) -> torch.Tensor:
    """One student step towards the frozen teacher's distribution."""
    with torch.no_grad():
        target = F.softmax(teacher(rows), dim=-1)
    loss = F.kl_div(F.log_softmax(student(rows), dim=-1), target, reduction="batchmean")
    loss.backward()
    opts["student"].step()
    opts["student"].zero_grad()
    return loss.detach()


def train(nets: dict[str, nn.Module], opts: dict, batches) -> list[list[float]]:
    """``STEPS`` steps of both loops on ``batches(step)``; per step the discriminator's,
    generator's and student's losses."""
    losses = []
    for step in range(STEPS):
        noise, real = batches(step)
        d_loss, g_loss = gan_step(nets["gen"], nets["disc"], opts, noise, real)
        kd_loss = distill_step(nets["teacher"], nets["student"], opts, real)
        losses.append(torch.stack([d_loss, g_loss, kd_loss]))
    return losses


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of ``t``: its full tensor when it is a DTensor."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def state(models: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Every parameter of every model, full, keyed ``model.name`` (``name`` for key "")."""
    return {f"{key}.{name}" if key else name: full(p) for key, model in models.items()
            for name, p in model.named_parameters()}


def job_two_models(rank: int, world_size: int, mode: str) -> dict:
    """Shard all four models, compile each on its own in "compiled" mode, train. Compiled
    without Inductor: the loop is the point, and Inductor's code for these models (five
    graphs) would cost the suite over two minutes."""
    models = build()
    for model in models.values():
        graphshard.shard(model)
    if mode == "compiled":
        nets = {key: torch.compile(model, backend=graphshard.backend(inductor=False))
                for key, model in models.items()}
    else:
        nets = models
    losses = train(nets, optimizers(models), lambda step: batch(step, rank))
    means = []
    for loss in losses:  # the rank mean, as the reference computes it
        dist.all_reduce(loss)
        means.append((loss / world_size).tolist())
    left = sum(p.grad is not None for model in models.values() for p in model.parameters())
    return {"losses": means, "state": state(models), "grads_left": left}


# ------------------------------------------------------------- blocks compiled one by one

LLAMA_STEPS = 3


def llama() -> nn.Module:
    """A small Hugging Face Llama from seed 0 (3 decoder layers)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=72, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False))  # fmt: skip


def token_ids(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s token ids at ``step``."""
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(10 * step + rank))


def sgd_steps(params, step_loss, steps: int, lr: float) -> list[torch.Tensor]:
    """``steps`` steps of SGD with momentum 0.9 on ``params``, each on ``step_loss(step)``;
    the losses, detached."""
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)
    losses = []
    for step in range(steps):
        loss = step_loss(step)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def _mean(losses: list[torch.Tensor]) -> torch.Tensor:
    return sum(losses) / len(losses)


def train_llama(model: nn.Module, batches) -> list[torch.Tensor]:
    """``LLAMA_STEPS`` steps of SGD with momentum on the causal LM loss of ``batches(step)``
    (a list of token-id batches whose losses are averaged)."""
    return sgd_steps(model.parameters(), lambda step: _mean(
        [model(input_ids=ids, labels=ids).loss for ids in batches(step)]), LLAMA_STEPS, lr=0.5)


def job_block_compile(rank: int, world_size: int, mode: str) -> dict:
    """Shard the whole model, then compile each decoder layer on its own: in place
    (``layer.compile``) or as torch.compile's wrapper put back in the list."""
    model = llama()
    graphshard.shard(model)
    layers = model.model.layers
    for index, layer in enumerate(layers):
        if mode == "module_compile":  # else "wrapped"
            layer.compile(backend="graphshard")
        else:
            layers[index] = torch.compile(layer, backend="graphshard")
    losses = train_llama(model, lambda step: [token_ids(step, rank)])
    means = []
    for loss in losses:
        dist.all_reduce(loss)
        means.append((loss / world_size).item())
    params = {name.replace("._orig_mod", ""): full(p) for name, p in model.named_parameters()}
    return {"losses": means, "state": params}


def reference_block_compile(world_size: int) -> dict:
    """The plain model, every rank's batch each step, in one process."""
    model = llama()
    losses = train_llama(model, lambda step: [token_ids(step, r) for r in range(world_size)])
    return {"losses": [loss.item() for loss in losses], "state": state({"": model})}


# ----------------------------------------------------------------- mixtures of experts

EXPERT_STEPS = 3


def mixtral() -> nn.Module:
    """A small Hugging Face Mixtral from seed 0 whose experts run Hugging Face's loop over the
    experts hit (``experts_implementation="eager"``): it reads the stacked ``gate_up_proj``
    and ``down_proj`` once per expert hit, so the number of reads follows the routing. 16
    experts, top 2, 8 tokens a rank: the ranks hit different experts."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        num_local_experts=16, num_experts_per_tok=2, use_cache=False,
        experts_implementation="eager"))  # fmt: skip


class EveryExpert(nn.Module):
    """A mixture of experts held in a ``ModuleList`` that calls every expert at every step,
    on the tokens routed to it (possibly none), as docs/failures.md advises instead of
    skipping an expert without tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(16, 4, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 24), nn.GELU(), nn.Linear(24, 16)) for _ in range(4))
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = self.router(x).argmax(-1)
        y = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = torch.where(route == e)[0]
            y = y.index_add(0, idx, expert(x[idx]))
        return self.out(x + y)


def every_expert() -> nn.Module:
    torch.manual_seed(0)
    return EveryExpert()


def expert_rows(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows for :class:`EveryExpert`: rank 1's are shifted so that the router
    sends none of them to some expert."""
    rows = torch.randn(6, 16, generator=torch.Generator().manual_seed(10 * step + rank))
    return rows + 3.0 * rank


def train_experts(models: dict[str, nn.Module], nets: dict[str, nn.Module],
                  batches) -> list[list[float]]:
    """``EXPERT_STEPS`` steps of SGD on both models; per step, each model's loss.
    ``batches(step)``: a list of (token ids, rows) pairs, one per rank's batch."""
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
            for k, m in models.items()}
    losses = []
    for step in range(EXPERT_STEPS):
        pieces = batches(step)
        lm = sum(nets["mixtral"](input_ids=ids, labels=ids).loss for ids, _ in pieces)
        moe = sum(nets["every_expert"](rows).square().mean() for _, rows in pieces)
        step_losses = [lm / len(pieces), moe / len(pieces)]
        for loss in step_losses:
            loss.backward()
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
        losses.append([loss.detach() for loss in step_losses])
    return losses


def expert_ids(step: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s token ids for the Mixtral at ``step``."""
    return torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(10 * step + rank))


def job_experts(rank: int, world_size: int, mode: str) -> dict:
    """Train both mixtures of experts sharded; Hugging Face's Mixtral only eagerly (its
    compiled step gathered each parameter once whatever the routing before eager reads shared
    their gathers, and is left out for the compile time). Also returns the
    experts each rank's Mixtral routed to in its first layer at the first step, and the
    experts ``EveryExpert`` gave no row at any step."""
    models = {"mixtral": mixtral(), "every_expert": every_expert()}
    hits: list[list[int]] = []
    models["mixtral"].model.layers[0].mlp.gate.register_forward_hook(
        lambda m, args, out: hits.append(sorted(set(out[-1].flatten().tolist()))))
    routes: list[torch.Tensor] = []
    models["every_expert"].router.register_forward_hook(
        lambda m, args, out: routes.append(out.detach().argmax(-1)))
    for model in models.values():
        graphshard.shard(model)
    nets = dict(models)
    if mode == "compiled":
        nets["every_expert"] = torch.compile(models["every_expert"], backend="graphshard")
    losses = train_experts(models, nets, lambda step: [(expert_ids(step, rank),
                                                        expert_rows(step, rank))])
    means = []
    for pair in losses:
        stacked = torch.stack(pair)
        dist.all_reduce(stacked)
        means.append((stacked / world_size).tolist())
    unused = sorted(set(range(4)) - set(torch.cat(routes).tolist()))
    return {"losses": means, "state": state(models), "hits": hits[0], "unused": unused}


def reference_experts(world_size: int) -> dict:
    """Both models in one process, every rank's batch each step."""
    models = {"mixtral": mixtral(), "every_expert": every_expert()}
    losses = train_experts(models, models, lambda step: [
        (expert_ids(step, r), expert_rows(step, r)) for r in range(world_size)])
    return {"losses": [[loss.item() for loss in pair] for pair in losses],
            "state": state(models)}


# ------------------------------------------------------------------------------- Muon

MUON_STEPS = 3


def muon_model() -> nn.Module:
    """From seed 0: odd widths, so that the Newton-Schulz matrices split unevenly."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 33), nn.GELU(), nn.Linear(33, 21), nn.GELU(),
                         nn.Linear(21, 5))


def muon_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    """torch's Muon for the 2-D weights (it takes nothing else), AdamW for the biases."""
    params = list(model.parameters())
    return [torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02),
            torch.optim.AdamW([p for p in params if p.ndim != 2], lr=0.01)]


def muon_rows(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(4, 12, generator=gen), torch.randn(4, 5, generator=gen)


def train_muon(model: nn.Module, batches) -> list[torch.Tensor]:
    """``MUON_STEPS`` steps of the mean squared error on ``batches(step)`` (a list of
    (rows, targets), one per rank's batch)."""
    opts = muon_optimizers(model)
    losses = []
    for step in range(MUON_STEPS):
        pieces = batches(step)
        loss = sum(F.mse_loss(model(x), y) for x, y in pieces) / len(pieces)
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        losses.append(loss.detach())
    return losses


def job_muon(rank: int, world_size: int, mode: str) -> dict:
    """The same model and loop sharded by graphshard (eager) and by FSDP2 (a ``fully_shard``
    per layer and on the root): the final parameters of each."""
    from torch.distributed.fsdp import fully_shard

    sharded = graphshard.shard(muon_model())
    fsdp2 = muon_model()
    for layer in fsdp2:
        if next(layer.parameters(), None) is not None:
            fully_shard(layer)
    fully_shard(fsdp2)
    out = {}
    for name, model in (("graphshard", sharded), ("fsdp2", fsdp2)):
        losses = train_muon(model, lambda step: [muon_rows(step, rank)])
        means = []
        for loss in losses:
            dist.all_reduce(loss)
            means.append((loss / world_size).item())
        out[name] = {"losses": means, "state": state({"": model})}
    return out


def reference_muon(world_size: int) -> dict:
    """The plain model, every rank's batch each step, in one process."""
    model = muon_model()
    losses = train_muon(model, lambda step: [muon_rows(step, r) for r in range(world_size)])
    return {"losses": [loss.item() for loss in losses], "state": state({"": model})}


# ------------------------------------------------------------------------ recurrent

RNN_STEPS = 3
RNN_MODES = ("eager", "compiled", "allow_rnn")


class Recurrent(nn.Module):
    """A language model of torch's own recurrent layers: an ``nn.LSTM`` (two layers), then an
    ``nn.GRU``. Both read their weights eagerly through ``getattr`` in ``forward``
    (``_flat_weights``), and Dynamo declines to trace them unless
    ``torch._dynamo.config.allow_rnn`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(48, 12)
        self.lstm = nn.LSTM(12, 20, num_layers=2, batch_first=True)
        self.gru = nn.GRU(20, 16, batch_first=True)
        self.out = nn.Linear(16, 48)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(ids))
        hidden, _ = self.gru(hidden)
        return F.cross_entropy(self.out(hidden).flatten(0, 1), ids.flatten())


def recurrent() -> nn.Module:
    torch.manual_seed(0)
    return Recurrent()


def recurrent_ids(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 48, (3, 7), generator=torch.Generator().manual_seed(10 * step + rank))


def train_recurrent(model: nn.Module, net: nn.Module, batches) -> list[torch.Tensor]:
    """``RNN_STEPS`` steps of SGD; ``batches(step)``: the list of batches whose mean loss a
    step takes."""
    return sgd_steps(model.parameters(), lambda step: _mean([net(ids) for ids in batches(step)]),
                     RNN_STEPS, lr=0.1)


def job_recurrent(rank: int, world_size: int, mode: str) -> dict:
    """Train :class:`Recurrent` sharded: eagerly, compiled (Dynamo leaves the recurrent layers,
    and the forward that calls them, to run eagerly), or compiled with ``allow_rnn`` (traced
    whole; without Inductor, whose code for the unrolled layers would cost the suite two
    minutes). Also returns the messages of the ``EagerForwardWarning`` raised."""
    from graphshard.api import eager_roots

    model = recurrent()
    graphshard.shard(model)
    backend = graphshard.backend(inductor=False) if mode == "allow_rnn" else "graphshard"
    net = model if mode == "eager" else torch.compile(model, backend=backend)
    eager_roots._WARNED.clear()  # warned once per process: each job starts afresh
    allow = torch._dynamo.config.allow_rnn
    torch._dynamo.config.allow_rnn = mode == "allow_rnn"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = train_recurrent(model, net, lambda step: [recurrent_ids(step, rank)])
    finally:
        torch._dynamo.config.allow_rnn = allow
    means = torch.stack(losses)
    dist.all_reduce(means)
    return {"losses": (means / world_size).tolist(), "state": state({"": model}),
            "warned": [str(w.message) for w in caught
                       if issubclass(w.category, graphshard.EagerForwardWarning)]}


def reference_recurrent(world_size: int) -> dict:
    """One process, every rank's batch each step."""
    model = recurrent()
    losses = train_recurrent(model, model, lambda step: [
        recurrent_ids(step, r) for r in range(world_size)])
    return {"losses": [loss.item() for loss in losses], "state": state({"": model})}


# ------------------------------------------------------------------ rollouts (unshard)

ROLLOUT_OPTIMIZERS = ("sgd", "adamw_fused")


def _rollout_optimizer(name: str, params) -> torch.optim.Optimizer:
    """SGD (torch's step through the DTensors) or fused AdamW (graphshard steps the local
    shards): a held copy must see either update."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def _greedy(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """``new_tokens`` greedy new tokens after ``prompt``, without gradients."""
    with torch.no_grad():
        return model.generate(prompt, attention_mask=torch.ones_like(prompt),
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)


def rollout(model: nn.Module, optimizer: str, prompts: dict[int, torch.Tensor]) -> dict:
    """An RL step as users write it, on ``prompts`` (rank -> its prompt: this rank's, or
    every rank's in one process): sample greedily (rank r's samples are 3 + r tokens longer
    than its prompt: the ranks decode different numbers of steps), train on the samples,
    then score them and sample again with the updated weights."""
    opt = _rollout_optimizer(optimizer, model.parameters())
    samples = [_greedy(model, prompt, 3 + rank) for rank, prompt in prompts.items()]
    _mean([model(input_ids=ids, labels=ids).loss for ids in samples]).backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        logits = [model(input_ids=ids).logits for ids in samples]
    return {"samples": samples, "logits": logits,
            "again": [_greedy(model, prompt, 3 + rank) for rank, prompt in prompts.items()]}


def rollout_prompt(rank: int) -> torch.Tensor:
    return token_ids(0, rank)[:, :4]


def job_rollout(rank: int, world_size: int, optimizer: str) -> dict:
    """:func:`rollout` inside ``graphshard.unshard(model)``: generation reads held copies
    and runs no collective, so the ranks may decode different numbers of steps (gathering
    per call, they would pair their gathers wrongly); the training forward gathers as always,
    and the optimizer step makes the held copies stale, so the reads after it gather again.
    (The backward gathers again what the training forward let go, reshard_after_forward=True:
    counted apart.)"""
    from graphshard.api.sharding import shard_state
    from graphshard.passes.markers import UNSHARD

    model = llama()
    graphshard.shard(model)
    gathers = Counter()
    with graphshard.unshard(model) as held, _count_gathers(gathers):
        held_names = held.parameter_names
        result = rollout(model, optimizer, {rank: rollout_prompt(rank)})
    return {**{key: value[0] for key, value in result.items()},
            "held": len(held_names), "gathers": gathers[UNSHARD] + gathers["all_gather"],
            "backward_gathers": (gathers[("backward", UNSHARD)]
                                 + gathers[("backward", "all_gather")]),
            "params": len(list(model.parameters())),
            "buckets": len({e.bucket for e in shard_state(model).params}),
            "state": {name: full(p) for name, p in model.named_parameters()}}


def reference_rollout(world_size: int, optimizer: str) -> dict:
    """:func:`rollout` of every rank's prompt in one process."""
    model = llama()
    result = rollout(model, optimizer, {r: rollout_prompt(r) for r in range(world_size)})
    return {**result, "state": state({"": model})}


@contextlib.contextmanager
def _count_gathers(counts: Counter):
    """Count the ops dispatched while active (the eager gathers are ``graphshard::unshard``
    and a bucket's all-gather, counted as ``"all_gather"``: on gloo the single-tensor
    collective, graphshard.safety.gloo_gather). The all-gather of one element, the ranks'
    comparison of their forwards (``graphshard.safety.rank_agreement``), is counted apart,
    as ``"digest"``, and what a backward dispatches as ``("backward", op)``."""
    from dist_utils import ALL_GATHER_SENT
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            key = func
            if func in ALL_GATHER_SENT:
                key = "digest" if args[ALL_GATHER_SENT[func]].numel() == 1 else "all_gather"
            if torch._C._current_graph_task_id() != -1:  # in a backward
                key = ("backward", key)
            counts[key] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        yield


# --------------------------------------------------------------------------- launch

JOBS = {"two_models": job_two_models, "block_compile": job_block_compile,
        "experts": job_experts, "muon": job_muon, "recurrent": job_recurrent,
        "rollout": job_rollout}


def run_jobs(rank: int, world_size: int, jobs: list[tuple[str, str]]) -> dict:
    """Entry point of each rank: every ``(job, mode)`` in turn; a job that raises records its
    traceback under ``"error"``."""
    counters = torch._dynamo.utils.counters
    results: dict = {}
    for job in jobs:
        torch._dynamo.reset()
        graphs = counters["stats"]["unique_graphs"]
        breaks = sum(counters["graph_break"].values())
        start = time.perf_counter()
        try:
            results[job] = JOBS[job[0]](rank, world_size, job[1])
        except Exception:  # noqa: BLE001  (the test fails with it)
            results[job] = {"error": traceback.format_exc()}
        results[job]["graphs"] = counters["stats"]["unique_graphs"] - graphs
        results[job]["breaks"] = sum(counters["graph_break"].values()) - breaks
        results[job]["seconds"] = time.perf_counter() - start
        dist.barrier()
    return results


def reference_two_models(world_size: int) -> dict:
    """The same loops in one process, every rank's rows in one batch."""
    models = build()

    def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = [batch(step, r) for r in range(world_size)]
        return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])

    losses = train(models, optimizers(models), batches)
    return {"losses": [loss.tolist() for loss in losses], "state": state(models)}
