"""Block regions called inside ``torch.utils.checkpoint`` bodies, with side effects of their own.

graphshard stores each block's gathered parameters on its modules around the region call and
takes them back after, through Dynamo's hatch for changes inside a higher-order op's body.
The hatch also marked the checkpoint body as one whose tensors escaped, so Dynamo returned
every intermediate of it, the region's included; a region whose own body has a side effect
(a Hugging Face Mamba's kernel-hub layer sets a global) then kept all its intermediates as
outputs, and one made under ``vmap`` (Mamba's associative scan) ended the compile
(``graphshard.api.hop_side_effects``). Real one-rank gloo group, against the model in one
process.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import graphshard


class _Switch:
    """An outside object a block's forward changes, as transformers' kernel-hub layers set
    the active kernels at every call."""

    active = None


_SWITCH = _Switch()


def _scaled(row: torch.Tensor) -> torch.Tensor:
    return row * row.sum()


class _VmappedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _SWITCH.active = "vmapped"  # a side effect of the block's own body
        return x + torch.vmap(_scaled)(self.linear(x))  # intermediates made under vmap


class _CheckpointedBlocks(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_VmappedBlock() for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x.square().mean()


def _region_outputs(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many outputs each ``invoke_subgraph`` body in Dynamo's graph ``gm`` returns."""
    counts = {}
    for name, module in gm.named_modules(remove_duplicate=False):
        for node in getattr(module, "graph", torch.fx.Graph()).nodes:
            if node.target is torch.ops.higher_order.invoke_subgraph:
                body = getattr(module, node.args[0].target)
                (returned,) = [n.args[0] for n in body.graph.nodes if n.op == "output"]
                counts[f"{name}.{node.args[0].target}"] = len(returned)
    return counts


def test_checkpointed_regions_with_side_effects_return_only_their_outputs_and_train(one_rank):
    torch.manual_seed(0)
    reference = _CheckpointedBlocks()
    model = copy.deepcopy(reference)
    x = torch.randn(4, 8)
    want = reference(x)
    want.backward()

    sharded = graphshard.shard(model)
    backend = graphshard.backend(inductor=False)
    region_outputs: list[dict[str, int]] = []

    def recording(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        region_outputs.append(_region_outputs(gm))
        return backend(gm, inputs)

    loss = torch.compile(sharded, backend=recording)(x)
    loss.backward()

    (outputs,) = region_outputs
    # (Dynamo gives block 0's region a body of its own, which torch 2.13 inlines, as a body
    # called once; blocks 1 and 2 share one)
    assert len(outputs) >= 2, f"blocks 1 and 2 should call a region each: {outputs}"
    assert set(outputs.values()) == {1}, (
        f"a region should return its block's output only, not its intermediates: {outputs}")
    assert torch.equal(loss, want)
    for (name, param), expected in zip(sharded.named_parameters(), reference.parameters(),
                                       strict=True):
        assert torch.equal(param.grad.full_tensor(), expected.grad), name
