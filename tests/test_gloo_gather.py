"""On gloo, graphshard's eager gathers avoid the collective that corrupts the heap
(:mod:`graphshard.safety.gloo_gather`): two real gloo ranks, one launch.

- An eager training step of a sharded model issues no ``_c10d_functional`` all-gather
  (gloo's ``allgather_into_tensor_coalesced``), yet gathers, and trains as before.
- :func:`graphshard.safety.gloo_gather.all_gather` issued while an all-to-all is in flight, as
  the eager step issues its gathers, gives the right values every time, and its output is
  completed by ``wait_tensor`` like the functional op's.
"""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks

ROUNDS = 2000


def _eager_step_and_overlapped_gathers(rank: int, world_size: int) -> dict:
    import torch.distributed as dist
    from torch import nn
    from torch.utils._python_dispatch import TorchDispatchMode

    import graphshard
    from graphshard.safety.gloo_gather import all_gather

    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    ops: list[str] = []

    class Names(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = graphshard.shard(nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x = torch.full((4, 8), float(rank + step + 1))
        with Names():
            loss = model(x).square().mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())

    wrong = []
    gen = torch.Generator().manual_seed(0)  # the same sizes on both ranks
    for i in range(ROUNDS):
        n = int(torch.randint(1, 2000, (1,), generator=gen))
        m = int(torch.randint(1, 2000, (1,), generator=gen))
        sent = torch.full((2 * n,), float(rank + 1))
        in_flight = c10d.all_to_all_single(sent, [n, n], [n, n], group)
        gathered = c10d.wait_tensor(all_gather(torch.full((m,), float(rank)), world_size, group))
        if not torch.equal(gathered, torch.arange(world_size).repeat_interleave(m).float()):
            wrong.append(("gather", i))
        received = c10d.wait_tensor(in_flight)
        if not torch.equal(received, torch.arange(1.0, world_size + 1).repeat_interleave(n)):
            wrong.append(("all_to_all", i))
    return {"ops": ops, "losses": losses, "wrong": wrong, "compiled": _compiled_steps(rank)}


def _compiled_steps(rank: int) -> dict:
    """Per Inductor-compiled configuration: the c10d collectives the steps ran (profiled),
    and the losses of the same steps, compiled and eager."""
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    import graphshard

    def losses(options: dict | None, names: list[str]) -> list[float]:
        torch.manual_seed(0)
        model = graphshard.shard(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16),
                                               nn.ReLU(), nn.Linear(16, 4)))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        if options is not None:
            model = torch.compile(model, backend=graphshard.backend(**options), fullgraph=True)
        out = []
        for step in range(3):
            x = torch.full((4, 8), float(rank + step + 1)) / 4
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                loss = model(x).square().mean()
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
            names.extend(e.name for e in prof.events() if e.name.startswith("c10d::"))
        return out

    eager = losses(None, [])
    found = {}
    for key, options in (("flat", {}),
                         ("coalesced", {"all_gather_via": "coalesced",
                                        "gather_from_storage": False})):
        names: list[str] = []
        found[key] = {"losses": losses(options, names), "eager": eager, "collectives": names}
    return found


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(_eager_step_and_overlapped_gathers, 2)


def test_the_eager_step_gathers_without_the_functional_all_gather(ranks):
    for result in ranks:
        functional = [op for op in result["ops"] if op.startswith("_c10d_functional.all_gather")]
        gathers = [op for op in result["ops"] if "allgather" in op or "all_gather" in op]
        assert functional == [], functional
        assert gathers, "the step gathered nothing"
        assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank its own batch


def test_gathers_issued_beside_an_all_to_all_in_flight_are_right(ranks):
    for result in ranks:
        assert result["wrong"] == []


def test_compiled_steps_on_gloo_gather_without_the_coalesced_collective(ranks):
    """Inductor-compiled steps on real gloo ranks run gloo's single-tensor all-gather
    (``_allgather_base_``), never ``allgather_into_tensor_coalesced_``, and train as the
    eager step does."""
    for result in ranks:
        for key, run in result["compiled"].items():
            names = set(run["collectives"])
            assert "c10d::_allgather_base_" in names, (key, names)
            assert not any("allgather_into_tensor_coalesced" in n for n in names), (key, names)
            torch.testing.assert_close(run["losses"], run["eager"], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- compiled graphs
# ``graphshard.passes.gloo_gathers`` on the lowered graphs of a fake group recorded as gloo
# (the pass reads what the backend recorded, never the group), then on two real gloo ranks.


@pytest.fixture
def recorded_as_gloo(monkeypatch):
    """A fake process group of 2 whose groups the backend records as gloo's."""
    from graph_utils import fake_process_group

    import graphshard.compiler.pipeline as pipeline

    monkeypatch.setattr(pipeline, "group_backend", lambda name, device: "gloo")
    with fake_process_group(2):
        torch.manual_seed(0)
        yield


def _lowered(**options) -> dict:
    from graph_utils import TwoBlock, compile_and_step

    import graphshard

    return compile_and_step(graphshard.shard(TwoBlock()), **options)


def _targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_compiled_gathers_of_a_gloo_group_are_single_tensor_gathers(recorded_as_gloo):
    from graph_utils import c10d, schedule_string

    from graphshard.passes.markers import ALL_GATHER_SINGLE

    stages = _lowered()
    for stage in ("fw", "bw"):
        targets = _targets(stages[stage])
        assert c10d.all_gather_into_tensor.default not in targets, stage
        assert c10d.all_gather_into_tensor_coalesced.default not in targets, stage
    fw = stages["fw"]
    singles = [n for n in fw.graph.nodes if n.target is ALL_GATHER_SINGLE]
    # the same schedule as the functional gathers' (test_graph_passes.LoweredGraphs)
    assert schedule_string(fw) == (
        "AG0:212 W(AG0) AG1:212 MM MM W(AG1) AG2:36 MM MM W(AG2) MM")
    # each gather reads its bucket's storage, a graph input: sent as it is, not copied
    assert len(singles) == 3
    assert all(n.kwargs["copy_input"] is False for n in singles)
    assert all(n.meta["graphshard"]["kind"] == "unshard" for n in singles)


def test_a_gather_of_an_intermediate_buffer_sends_a_copy(recorded_as_gloo):
    from graphshard.passes.markers import ALL_GATHER_SINGLE

    stages = _lowered(gather_from_storage=False)
    singles = [n for n in stages["fw"].graph.nodes if n.target is ALL_GATHER_SINGLE]
    assert [n.args[0].target for n in singles] == [torch.ops.aten.cat.default] * 3
    assert all(n.kwargs["copy_input"] is True for n in singles)


def test_a_coalesced_gather_of_a_gloo_group_is_one_gather_per_piece(recorded_as_gloo):
    from graphshard.passes.markers import ALL_GATHER_SINGLE

    stages = _lowered(all_gather_via="coalesced")
    fw = stages["fw"]
    singles = [n for n in fw.graph.nodes if n.target is ALL_GATHER_SINGLE]
    # TwoBlock's buckets: two blocks of (weight, bias, weight, bias), the head's (weight, bias)
    assert len(singles) == 10
    waits = [u for n in singles for u in n.users]
    assert all(u.target is torch.ops._c10d_functional.wait_tensor.default for u in waits)
    assert len(waits) == len(singles)


def test_other_backends_keep_the_functional_gather():
    from graph_utils import c10d, fake_process_group

    from graphshard.passes.markers import ALL_GATHER_SINGLE

    with fake_process_group(2):
        torch.manual_seed(0)
        stages = _lowered()
    targets = _targets(stages["fw"])
    assert ALL_GATHER_SINGLE not in targets
    assert targets.count(c10d.all_gather_into_tensor.default) == 3
