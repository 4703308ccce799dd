"""Shared by the graph-level tests (test modules never import each other): a fake process
group, ways to read transformed graphs, and the small models they shard."""

from __future__ import annotations

import re

import torch
from torch import fx, nn

from graphshard.offline import fake_process_group  # noqa: F401  (re-exported for tests)

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


def calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    """The call_function nodes of ``gm`` with ``target``, in order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


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


MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def derived_before_matmul(node: fx.Node) -> set[fx.Node]:
    """``node`` and what is computed from it without passing through a matmul."""
    found, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(u for u in n.users if u.target not in MATMULS)
    return found


def saved_for_backward(fw: fx.GraphModule, num_user_outputs: int) -> list[fx.Node]:
    """The forward graph's outputs beyond the user's: what it saves for backward."""
    outputs = fw.graph.find_nodes(op="output")[0].args[0]
    return [o for o in outputs[num_user_outputs:] if isinstance(o, fx.Node)]


def graph_text(gm: fx.GraphModule, group_name: str) -> str:
    """The readable graph without comments or file paths, with the group name as ``G``.

    Non-tensor graph inputs (the opaque device-mesh objects AOTAutograd passes along with
    each DTensor parameter) are left out of the signature and of the returned tuples: which
    of them the partitioner keeps depends on what ran before in the process.
    """
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    lines = [ln.rstrip() for ln in code.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.lstrip().startswith("#")]
    opaque = [n.name for n in gm.graph.find_nodes(op="placeholder")
              if not isinstance(n.meta.get("val"), torch.Tensor)]
    if opaque:
        names = re.compile(r",? ?\b(?:" + "|".join(map(re.escape, opaque)) + r")\b(?=[,)])")
        lines = [names.sub("", ln) if ln.lstrip().startswith(("def forward", "return ("))
                 else ln for ln in lines]
    return "\n".join(lines).replace(f"'{group_name}'", "'G'") + "\n"


class Block(nn.Module):
    """A residual two-Linear block (8 -> 12 -> 8): the unit of the small graph-test models."""

    def __init__(self, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


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
