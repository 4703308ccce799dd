"""Shared by the graph-level tests (test modules never import each other): a fake process
group, ways to read transformed graphs, and the small models they shard."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import fx, nn

import graphshard
from graphshard.passes.markers import ALL_GATHER_SINGLE, TAKE_PREFETCHED
from graphshard.tools.offline import fake_process_group  # noqa: F401  (re-exported for tests)

c10d = torch.ops._c10d_functional

REBUILD_OPS = {
    c10d.wait_tensor.default,
    torch.ops.aten.view.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.t.default,
    torch.ops.aten._unsafe_view.default,
}


# A forward's leading all-gathers are ``take_prefetched`` (the all-gather, which the optimizer
# step may have issued already: graphshard.passes.step_prefetch), and a gloo group's are
# ``all_gather_single`` (graphshard.passes.gloo_gathers); ``calls`` counts them as one.
_SAME_AS = {c10d.all_gather_into_tensor.default: (TAKE_PREFETCHED, ALL_GATHER_SINGLE)}


def compile_and_step(model: nn.Module, **backend_options) -> dict:
    """Compile ``model`` (sharded) with the graph-only backend, run forward and backward on
    a ``[4, 8]`` input, return the graphs of each stage."""
    backend = graphshard.backend(inductor=False, **backend_options)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(torch.randn(4, 8)).sum().backward()
    (stages,) = backend.graphs
    return stages


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    """The call_function nodes of ``gm`` with ``target``, in order (for the all-gather, its
    ``take_prefetched`` and ``all_gather_single`` forms included)."""
    targets = (target, *_SAME_AS.get(target, ()))
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


def gathered_values(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes that are an all-gather or derive from one through view/rebuild ops only."""
    return derived_from(*calls(gm, c10d.all_gather_into_tensor.default))


def derived_from(*gathers: fx.Node) -> set[fx.Node]:
    """``gathers`` and the nodes derived from them through view/rebuild ops only."""
    found = set(gathers)
    if not gathers:
        return found
    for node in gathers[0].graph.nodes:
        if node.op == "call_function" and node.target in REBUILD_OPS:
            if any(isinstance(a, fx.Node) and a in found for a in node.args):
                found.add(node)
    return found


# A block region's call (``invoke_subgraph``, ``shard(compile_blocks_once=True)``) stands for
# the matmuls of its body: the step graph's compute, for the schedule's purposes.
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
           torch.ops.higher_order.invoke_subgraph}


def derived_before_matmul(node: fx.Node) -> set[fx.Node]:
    """``node`` and what is computed from it without passing through a matmul."""
    found, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(u for u in n.users if u.target not in MATMULS)
    return found


_SCHEDULE_TOKENS = {
    c10d.all_gather_into_tensor.default: "AG",
    TAKE_PREFETCHED: "AG",
    ALL_GATHER_SINGLE: "AG",
    c10d.reduce_scatter_tensor.default: "RS",
    c10d.all_reduce.default: "AR",
}


def schedule_string(gm: fx.GraphModule) -> str:
    """The graph's schedule as a normalised string, free of node names and torch's own
    lowering details: ``AG0:212`` is the first all-gather (212 elements gathered), ``W(AG0)``
    its wait, ``MM`` a matmul, ``RS1:106`` the second reduce-scatter (106 elements in). A block
    region's call reads as the matmuls of its body: torch 2.13's Dynamo inlines a region
    called once, 2.11's keeps the call, and both give the same string."""
    seen: dict[str, int] = {}
    label: dict[fx.Node, str] = {}
    tokens = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        kind = _SCHEDULE_TOKENS.get(node.target)
        if kind is not None:
            index = seen.get(kind, 0)
            seen[kind] = index + 1
            label[node] = f"{kind}{index}"
            size = (node.meta["val"] if kind == "AG" else node.args[0].meta["val"]).numel()
            tokens.append(f"{label[node]}:{size}")
        elif node.target is c10d.wait_tensor.default:
            tokens.append(f"W({label.get(node.args[0], '?')})")
        elif node.target is torch.ops.higher_order.invoke_subgraph:
            tokens.extend(["MM"] * _body_matmuls(getattr(gm, node.args[0].target)))
        elif node.target in MATMULS:
            tokens.append("MM")
    return " ".join(tokens)


def _body_matmuls(body: fx.GraphModule) -> int:
    """The matmuls a region body runs, those of regions it calls included."""
    count = 0
    for node in body.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.ops.higher_order.invoke_subgraph:
            count += _body_matmuls(getattr(body, node.args[0].target))
        elif node.target in MATMULS:
            count += 1
    return count


def saved_for_backward(fw: fx.GraphModule, num_user_outputs: int) -> list[fx.Node]:
    """The forward graph's outputs beyond the user's: what it saves for backward."""
    outputs = fw.graph.find_nodes(op="output")[0].args[0]
    return [o for o in outputs[num_user_outputs:] if isinstance(o, fx.Node)]


class Block(nn.Module):
    """A residual two-Linear block (8 -> 12 -> 8): the unit of the small graph-test models."""

    def __init__(self, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class BlockStack(nn.Module):
    """``n`` ``Block``s in a ModuleList (one bucket each), no head."""

    def __init__(self, n: int, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, hidden) for _ in range(n)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class TwoBlock(nn.Module):
    """Two ``Block``s and a head (8 -> 3): three buckets, the model of most graph tests."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Breaks(TwoBlock):
    """``TwoBlock`` with a graph break between its blocks: two graphs, the second starting
    with block 1's bucket."""

    def forward(self, x):
        x = self.blocks[0](x)
        torch._dynamo.graph_break()
        x = self.blocks[1](x)
        return self.head(x)


def sharded_with_grads(build, mesh=None, scale: float = 1.0) -> nn.Module:
    """``build()``'s model from seed 0, sharded over ``mesh``, with the same gradients at
    every call (seeded, times ``scale``), each on its parameter's placements."""
    from torch.distributed.tensor import DTensor

    import graphshard

    torch.manual_seed(0)
    model = graphshard.shard(build(), mesh)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        local = torch.randn(p.to_local().shape, generator=gen) * scale
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                    stride=p.stride())
    return model


@contextlib.contextmanager
def in_fake_world(size: int, rank: int = 0) -> Iterator[None]:
    """Rank ``rank`` of ``bench.fake_world``: collectives that move real data, in this
    process (every other rank imagined to hold what this one holds); afterwards Dynamo is
    reset and the world shut down."""
    from bench.fake_world import init_fake_world, shutdown_fake_world

    init_fake_world(size, rank)
    try:
        yield
    finally:
        torch._dynamo.reset()
        shutdown_fake_world()


class KeyedLayersLlama(nn.Module):
    """graphshard's Llama with its blocks in an ``nn.ModuleDict`` keyed "0", "1", ..., as
    torchtitan's models hold them (and iterate ``self.layers.values()``): the same parameter
    names and values as the ``ModuleList`` model it is made from."""

    def __init__(self, llama: nn.Module) -> None:
        super().__init__()
        self.tok_embeddings, self.rope = llama.tok_embeddings, llama.rope
        self.layers = nn.ModuleDict({str(i): block for i, block in enumerate(llama.layers)})
        self.norm, self.output = llama.norm, llama.output

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor):
        from graphshard.models.llama import LlamaOutput

        cos, sin = self.rope(input_ids.shape[1])
        h = self.tok_embeddings(input_ids)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        return LlamaOutput(loss, logits)


def exception_chain(error: BaseException | None) -> list[BaseException]:
    """``error`` and what it wraps, outermost first: Dynamo wraps what a backend raises
    (``BackendCompilerFailed``, whose ``inner_exception`` it is; torch 2.11 sets no
    ``__cause__`` there), and graphshard's errors name torch's as their cause."""
    chain: list[BaseException] = []
    while error is not None and error not in chain:
        chain.append(error)
        error = getattr(error, "inner_exception", None) or error.__cause__
    return chain
