"""World 1: one rank, no replicas. The lowered graphs are a plain model's (no collective, no
buffer, no copy), and training matches the unsharded model step for step."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from graph_utils import TwoBlock, fake_process_group
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition

import graphshard
from graphshard.models.llama import Llama, llama_config
from graphshard.passes.fx_util import LOWERED
from graphshard.passes.traffic import VIEWS

STEPS = 3


def _graphshard_graphs(model: nn.Module, *inputs, **shard_options) -> dict[str, fx.GraphModule]:
    backend = graphshard.backend(inductor=False)
    compiled = torch.compile(graphshard.shard(model, **shard_options), backend=backend,
                             fullgraph=True)
    _loss(compiled(*inputs)).backward()
    return backend.graphs[-1]  # (mixed precision casts the inputs in a graph of their own)


def _plain_graphs(model: nn.Module, *inputs) -> dict[str, fx.GraphModule]:
    """The forward and backward graphs plain ``torch.compile`` hands Inductor (same
    decompositions and partitioner as graphshard's backend)."""
    from torch._inductor.decomposition import select_decomp_table

    graphs = {}

    def keep(stage):
        def compiler(gm, example_inputs):
            graphs[stage] = gm
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                           partition_fn=min_cut_rematerialization_partition,
                           decompositions=select_decomp_table())
    _loss(torch.compile(model, backend=backend, fullgraph=True)(*inputs)).backward()
    return graphs


def _loss(output) -> torch.Tensor:
    loss = getattr(output, "loss", None)
    return loss if loss is not None else output.float().sum()


def _ops(gm: fx.GraphModule) -> Counter:
    """The graph's operations that move or compute data, by target (views left out)."""
    return Counter(str(n.target) for n in gm.graph.nodes
                   if n.op == "call_function" and n.target not in VIEWS)


def _communication(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and getattr(n.target, "namespace", None) in ("_c10d_functional", "c10d")]


def _models():
    def two_block():
        torch.manual_seed(0)
        return TwoBlock(), (torch.randn(4, 8),)

    def llama_tied():
        torch.manual_seed(0)
        cfg = llama_config("tiny", tie_embeddings=True)
        return Llama(cfg), (torch.randint(0, cfg.vocab_size, (2, 16)),)

    return {"two_block": two_block, "llama_tied": llama_tied}


@pytest.mark.parametrize("name", ["two_block", "llama_tied"])
def test_world1_graphs_are_the_plain_models(name):
    build = _models()[name]
    model, inputs = build()
    plain = _plain_graphs(model, *inputs)
    with fake_process_group(1):
        model, inputs = build()
        # each block inlined, as plain torch.compile traces it (block regions: test_block_regions)
        sharded = _graphshard_graphs(model, *inputs, compile_blocks_once=False)
    for stage in ("fw", "bw"):
        assert _communication(sharded[stage]) == [], stage
        assert not [n for n in sharded[stage].graph.nodes if LOWERED in n.meta], stage
        assert _ops(sharded[stage]) == _ops(plain[stage]), stage


def _inductor_graphs(model: nn.Module, *inputs) -> dict[str, fx.GraphModule]:
    """The graphs plain ``torch.compile``'s Inductor backend compiles: a training step's
    forward and backward partitioned by Inductor's own partition function (its joint-graph
    passes first), or, under ``no_grad``, the inference graph after those passes."""
    from torch._inductor.compile_fx import (
        _recursive_joint_graph_passes,
        get_inputs_devices,
        partition_fn,
    )
    from torch._inductor.decomposition import select_decomp_table

    graphs = {}

    def keep(stage):
        def compiler(gm, example_inputs):
            if stage == "inference":  # what Inductor's forward compiler runs first
                device = next(iter(get_inputs_devices(example_inputs, gm)))
                gm = _recursive_joint_graph_passes(gm, input_device=device)
            graphs[stage] = gm
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                           inference_compiler=keep("inference"), partition_fn=partition_fn,
                           decompositions=select_decomp_table())
    output = torch.compile(model, backend=backend, fullgraph=True)(*inputs)
    if torch.is_grad_enabled():
        _loss(output).backward()
    return graphs


class _NextTokenLoss(nn.Module):
    """A language model's next-token cross-entropy, outside the model (Hugging Face's own
    loss logs a warning, which ``fullgraph`` refuses)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids=ids).logits
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


class _WrittenOutAttention(nn.Module):
    """Self-attention as softmax(q k^T / sqrt(d)) v, spelled out: Inductor's joint-graph
    passes rewrite it to fused scaled-dot-product attention."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, dim) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, -1).transpose(1, 2) for f in self.qkv)
        weights = (q @ k.transpose(-2, -1)).div((d // self.heads) ** 0.5).softmax(dim=-1)
        return (weights @ v).transpose(1, 2).reshape(b, t, d)


def _joint_pass_models():
    def hf_gpt2_eager_attention():
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                         eos_token_id=0, attn_implementation="eager")
        return _NextTokenLoss(GPT2LMHeadModel(cfg)), (torch.randint(0, 256, (2, 16)),)

    def written_out_attention():
        torch.manual_seed(0)
        return _WrittenOutAttention(), (torch.randn(2, 32, 64),)

    return {"llama_tied": _models()["llama_tied"],
            "hf_gpt2_eager_attention": hf_gpt2_eager_attention,
            "written_out_attention": written_out_attention}


@pytest.mark.parametrize("name, grad", [
    ("llama_tied", True), ("llama_tied", False), ("hf_gpt2_eager_attention", True),
    ("written_out_attention", True),
])
def test_world1_graphs_inductor_gets_are_the_plain_models_after_its_joint_passes(
        one_rank, name, grad):
    """Inductor rewrites a graph before compiling it (its joint-graph passes: patterns that
    fuse, constants folded), a training step's before partitioning it. graphshard partitions
    the joint itself and must run them too: without them a loss's backward builds a
    (tokens x vocabulary) zero tensor and scatters into it, where Inductor computes it
    pointwise; attention written out stays unfused, where Inductor calls fused
    scaled-dot-product attention."""
    build = _joint_pass_models()[name]
    stages = ("fw", "bw") if grad else ("inference",)
    with torch.set_grad_enabled(grad):
        model, inputs = build()
        plain = _inductor_graphs(model, *inputs)
        torch._dynamo.reset()
        model, inputs = build()
        backend = graphshard.backend(aot_cache=False)
        # each block inlined, as plain torch.compile traces it (regions: test_block_regions)
        compiled = torch.compile(graphshard.shard(model, compile_blocks_once=False),
                                 backend=backend, fullgraph=True)
        output = compiled(*inputs)
        if grad:
            _loss(output).backward()
    (graphs,) = backend.graphs
    for stage in stages:
        assert _ops(graphs[stage]) == _ops(plain[stage]), stage
    rewritten = {"written_out_attention": "aten._scaled_dot_product_flash_attention_for_cpu"}
    if name in rewritten:  # the rewrite happened on the plain model, so graphshard's has it
        assert any(op.startswith(rewritten[name]) for op in _ops(plain["fw"]))
    elif grad:  # the loss's: the zero tensor and its scatter are gone
        assert not _ops(plain["bw"])[str(torch.ops.aten.scatter.value)]


def test_world1_mixed_precision_keeps_only_the_casts():
    policy = graphshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with fake_process_group(1):
        torch.manual_seed(0)
        stages = _graphshard_graphs(TwoBlock(), torch.randn(4, 8), mixed_precision=policy)
    cast = torch.ops.prims.convert_element_type.default
    for stage in ("fw", "bw"):
        assert _communication(stages[stage]) == [], stage
        made = [n for n in stages[stage].graph.nodes if LOWERED in n.meta]
        assert made and all(n.target is cast for n in made), stage
    fw_casts = [n for n in stages["fw"].graph.nodes if LOWERED in n.meta]
    assert {n.meta["val"].dtype for n in fw_casts} == {torch.bfloat16}
    assert len(fw_casts) == len(list(TwoBlock().parameters()))  # each shard cast once
    # the bf16 gradients are reduced in fp32: one cast each, straight to .grad
    bw_casts = [n for n in stages["bw"].graph.nodes if LOWERED in n.meta
                and n.meta[LOWERED]["side"] == "reduce_grad"]
    assert {n.meta["val"].dtype for n in bw_casts} == {torch.float32}
    assert len(bw_casts) == len(list(TwoBlock().parameters()))


def _train(model: nn.Module, run, batches) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for batch in batches:
        loss = _loss(run(*batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
             for k, v in model.state_dict().items()}
    return losses, state


@pytest.mark.parametrize("name", ["two_block", "llama_tied"])
def test_world1_training_equals_the_unsharded_model(one_rank, name):
    build = _models()[name]
    model, first = build()
    gen = torch.Generator().manual_seed(1)
    batches = [first] + [
        (torch.randn(first[0].shape, generator=gen) if first[0].is_floating_point()
         else torch.randint(0, 256, first[0].shape, generator=gen),)
        for _ in range(STEPS - 1)
    ]
    torch._dynamo.reset()
    plain_model, _ = build()
    plain = _train(plain_model, torch.compile(plain_model), batches)
    torch._dynamo.reset()
    eager_model, _ = build()
    eager = _train(eager_model, eager_model, batches)
    torch._dynamo.reset()
    model, _ = build()
    sharded_model = graphshard.shard(model)
    sharded = _train(sharded_model, torch.compile(sharded_model, backend=graphshard.backend()),
                     batches)
    # bit for bit the plain compiled model (the same graphs), and the eager one to round-off
    assert sharded[0] == plain[0]
    for key, value in plain[1].items():
        torch.testing.assert_close(sharded[1][key], value, rtol=0, atol=0, msg=key)
    torch.testing.assert_close(torch.tensor(sharded[0]), torch.tensor(eager[0]))
    for key, value in eager[1].items():
        torch.testing.assert_close(sharded[1][key], value, msg=key)


# (case, mode, accum, mesh, precision) of ``accum_parity``: no_sync folds held-back
# gradients in at world 1 too, a 0-D parameter and padding-free shapes alike. Lowered (the
# passes' graphs without Inductor): the folding is the passes', and the world-2 launch of
# ``test_accumulation`` has it through Inductor.
ACCUM_JOBS = [
    ("mlp_odd", "lowered", "no_sync", "1d", "fp32"),
    ("odd_params", "lowered", "sync", "1d", "fp32"),
    ("llama_tied", "lowered", "no_sync", "1d", "fp32"),
    # shard(gradient_divide_factor=4.0): each gradient (the sum over one rank) divided by 4,
    # the loss scaled by 4 to make up for it; eager and lowered (where it is one multiply)
    ("mlp_odd", "eager", "sync", "1d", "fp32", 4.0),
    ("mlp_odd", "lowered", "no_sync", "1d", "fp32", 4.0),
    # a weight read under torch.no_grad() before the read that trains: compiled, it got no
    # gradient at all (the traced reads were merged into the first), and once given one, no
    # held-back gradient (the first read took it)
    ("no_grad_read_first", "lowered", "no_sync", "1d", "fp32"),
]


@pytest.mark.parametrize("job", ACCUM_JOBS,
                         ids=["-".join(map(str, j[:3] + j[5:])) for j in ACCUM_JOBS])
def test_world1_accumulation_matches_single_process(one_rank, job):
    from accum_parity import train_reference, train_sharded
    from parity import assert_matches

    assert_matches(train_sharded(0, 1, *job), train_reference(job[0], 1))


def test_world1_mixed_precision_matches_the_eager_kernels(one_rank):
    from accum_parity import train_sharded
    from parity import assert_matches

    job = ("no_sync", "1d", "bf16/fp32")
    eager = train_sharded(0, 1, "mlp_odd", "eager", *job)
    # bf16 compute of the decomposed graph rounds differently from the eager modules; the
    # casts themselves are the eager kernels' (a wrong cast or a skipped one is off by far more)
    assert_matches(train_sharded(0, 1, "mlp_odd", "lowered", *job), eager, rtol=1e-2, atol=1e-3)


def dp1_tp2_job(rank: int, world_size: int) -> dict:
    """dp 1 x tp 2: the shard group has one rank, tensor parallelism still splits."""
    import tp_jobs
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for mode in ("lowered", "compiled"):
        model = tp_jobs._tp_model("mlp", mesh["tp"], mesh["dp"])
        out[mode] = {**tp_jobs._train(model, mode, 0, "mlp"), "params": tp_jobs._params(model)}
        model = tp_jobs._tp_model("mlp", mesh["tp"], mesh["dp"])
        out[("no_sync", mode)] = {**tp_jobs._train(model, mode, 0, "mlp", accum=2),
                                  "params": tp_jobs._params(model)}
    return out


def test_world1_shard_group_under_tensor_parallelism_matches_one_process():
    import tp_jobs
    from dist_utils import run_ranks

    results = run_ranks(dp1_tp2_job, 2)
    for key, accum in [("lowered", 1), ("compiled", 1), (("no_sync", "lowered"), 2),
                       (("no_sync", "compiled"), 2)]:
        reference = tp_jobs.reference("mlp", 1, accum=accum)
        for res in results:
            got = res[key]
            assert got["losses"] == pytest.approx(reference["losses"][0], rel=1e-5), key
            assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5), key
            for name, value in reference["params"].items():
                torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6,
                                           msg=f"{key} {name}")


def test_the_kept_graphs_are_the_passes_output_after_inductor_compiled_them(one_rank, tmp_path):
    """Inductor's post-grad passes rewrite the graph they get in place; ``backend.graphs``
    must still hold what graphshard's passes produced (the summaries and traffic counts read
    it), so it must match the last dump of each stage byte for byte."""
    torch.manual_seed(0)
    cfg = llama_config("tiny")
    backend = graphshard.backend(dump_dir=str(tmp_path))
    compiled = torch.compile(graphshard.shard(Llama(cfg)), backend=backend, fullgraph=True)
    _loss(compiled(torch.randint(0, cfg.vocab_size, (2, 16)))).backward()
    (stages,) = backend.graphs
    for stage in ("fw", "bw"):
        last = sorted(tmp_path.rglob(f"{stage}_[0-9][0-9]_*.txt"))[-1]
        kept = stages[stage].print_readable(
            print_output=False, include_stride=False, include_device=False)
        assert kept == last.read_text(), stage
