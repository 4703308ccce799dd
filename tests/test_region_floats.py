"""Block regions that would take a float (``graphshard.passes.inline_regions``): a second
model of the same class, compiled after the first, makes Dynamo trace the blocks' float
attributes as dynamic values, which ``invoke_subgraph`` refuses. Those blocks are inlined,
so the model still compiles into one graph and trains as one process does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from graph_utils import fake_process_group
from torch import nn

import graphshard
from graphshard.passes.regions import region_calls


class ScaledBlock(nn.Module):
    """A residual block whose output is scaled by a float attribute, as attention scales
    its scores by ``head_dim ** -0.5``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.scaling = dim**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x)) * self.scaling


class ScaledNet(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embed = nn.Linear(4, dim)
        self.layers = nn.ModuleList([ScaledBlock(dim) for _ in range(3)])
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_blocks_given_a_dynamic_float_are_inlined_into_one_graph():
    """The first model's blocks run as one region; the second model's (another width, so
    Dynamo's recompile makes ``scaling`` dynamic) are inlined and it still compiles with
    ``fullgraph=True``. Before, AOTAutograd refused the region ("invoke_subgraph operands
    must be a list of tensors/ints/SymInts")."""
    backend = graphshard.backend(inductor=False)
    with fake_process_group(2, rank=1):
        for dim in (16, 8):
            torch.manual_seed(0)
            model = graphshard.shard(ScaledNet(dim))
            out = torch.compile(model, backend=backend, fullgraph=True)(torch.randn(3, 4))
            out.sum().backward()
            assert model.layers[0].proj.weight.grad is not None
    first, second = (stages["dynamo"] for stages in backend.graphs)
    assert len(list(region_calls(first))) == 3
    assert list(region_calls(second)) == []
    referenced = {n.target for n in second.graph.nodes if n.op == "get_attr"}
    assert {name for name, _ in second.named_children()} <= referenced  # no dead body left
    unshard = torch.ops.graphshard.unshard.default
    gathered = [n for n in second.graph.nodes if n.target is unshard]
    assert len(gathered) == 2 * 3 + 4  # every block's weight and bias, embed and head


def _llama(hidden: int, ffn: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        use_cache=False))  # fmt: skip


def _distill(teacher: nn.Module, student: nn.Module, steps: int) -> list[float]:
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(step))
        with torch.no_grad():
            target = F.softmax(teacher(input_ids=ids).logits, dim=-1).flatten(0, 1)
        log_probs = F.log_softmax(student(input_ids=ids).logits, dim=-1).flatten(0, 1)
        loss = F.kl_div(log_probs, target, reduction="batchmean")
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _sharded_distillation(teacher: nn.Module, student: nn.Module, inductor: bool):
    """Shard copies of both, compile each with ``fullgraph=True`` on one backend and distill
    for 3 steps: the losses, the student's full parameters and the backend."""
    teacher, student = copy.deepcopy(teacher), copy.deepcopy(student)
    backend = graphshard.backend(inductor=inductor)
    compiled = [torch.compile(graphshard.shard(m), backend=backend, fullgraph=True)
                for m in (teacher, student)]
    losses = _distill(*compiled, 3)
    return losses, [p.full_tensor() for p in student.parameters()], backend


@pytest.mark.parametrize("inductor", [False, True], ids=["aot_eager", "inductor"])
def test_a_student_of_its_teachers_class_compiles_whole_and_trains_like_one_process(
        one_rank, inductor):
    """Hugging Face Llama distilled into a narrower Llama, both sharded and compiled with
    ``fullgraph=True``: the student's compile is Dynamo's recompile of the teacher's code.
    Before, its attention blocks (``self.scaling``) failed in the backend and Dynamo fell
    back to running them eagerly (``fullgraph=True`` raised).

    With Inductor and AOTAutogradCache (torch >= 2.13) the run is repeated after
    ``torch._dynamo.reset()``, where
    AOTAutogradCache answers the compiles and the backend traces the graphs again on
    reading them; that trace restarted, as Dynamo does for a float it specialises, and the
    restart escaped (``TensorifyScalarRestartAnalysis``)."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    teacher, student = _llama(64, 128).requires_grad_(False).eval(), _llama(32, 72)
    plain_student = copy.deepcopy(student)
    plain = _distill(copy.deepcopy(teacher), plain_student, 3)
    runs = 2 if inductor and graphshard.backend().aot_cache else 1
    for run in range(runs):
        torch._dynamo.reset()
        losses, params, backend = _sharded_distillation(teacher, student, inductor)
        torch.testing.assert_close(losses, plain, rtol=1e-5, atol=1e-6)
        for got, want in zip(params, plain_student.parameters(), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if run:  # on torch >= 2.13, where the backend uses AOTAutogradCache by default
            assert backend.aot_cache
            assert backend.aot_cache_hits >= 2  # the teacher's graph and the student's
        teacher_graphs = [g["dynamo"] for g in backend.graphs if "inference" in g]
        student_graphs = [g["dynamo"] for g in backend.graphs if "fw" in g]
        assert [len(list(region_calls(g))) for g in teacher_graphs] == [2]  # its layers
        assert [len(list(region_calls(g))) for g in student_graphs] == [0]  # inlined
