"""Dynamo's comparison of two block regions answers "not the same" instead of failing on a
body whose ``autograd.Function`` backward has unused inputs (torch 2.11 met it in Hugging
Face BLOOM: graphshard/safety/region_compare.py)."""

from __future__ import annotations

import pytest
import torch
from torch import fx
from torch._dynamo.variables import higher_order_ops

from graphshard.safety.region_compare import (
    region_compare_tolerates_unused_inputs_in_this_process,
)


def _body_with_an_unused_input() -> fx.GraphModule:
    """What Dynamo builds for an ``autograd.Function``'s backward: an unused input is a
    placeholder without an ``example_value``."""
    graph = fx.Graph()
    graph.placeholder("unused_0")
    graph.output(None)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_two_bodies_with_unused_inputs_compare_as_different_and_nothing_raises():
    region_compare_tolerates_unused_inputs_in_this_process()
    region_compare_tolerates_unused_inputs_in_this_process()  # idempotent
    compare = higher_order_ops.are_same_graph_modules
    assert compare.torch_compare is not compare
    first, second = _body_with_an_unused_input(), _body_with_an_unused_input()
    assert compare("_block_body", first, second, None) is False
    # torch's own comparison fails on them (if a torch stops failing, the workaround can go)
    with pytest.raises(KeyError, match="example_value"):
        compare.torch_compare("_block_body", first, second, None)


def test_bodies_with_example_values_are_still_compared_by_torch():
    region_compare_tolerates_unused_inputs_in_this_process()
    graphs = []
    for _ in range(2):
        graph = fx.Graph()
        node = graph.placeholder("x")
        node.meta["example_value"] = 3  # neither a tensor nor a size: torch compares no value
        graph.output(node)
        graphs.append(fx.GraphModule(torch.nn.Module(), graph))
    assert higher_order_ops.are_same_graph_modules("_block_body", *graphs, None) is True
