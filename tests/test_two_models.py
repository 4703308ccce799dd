"""Two sharded models in one step (a GAN, a frozen teacher with its student), eager and
compiled on 2 gloo ranks, against one process (``two_models_jobs``)."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from two_models_jobs import MODES, STEPS, build, reference, run_jobs

WORLD = 2


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(run_jobs, WORLD, MODES)


@pytest.fixture(scope="module")
def plain() -> dict:
    return reference(WORLD)


def _result(ranks: list[dict], mode: str) -> list[dict]:
    for rank, res in enumerate(ranks):
        if "error" in res[mode]:
            pytest.fail(f"{mode}, rank {rank} raised:\n{res[mode]['error']}")
    return [res[mode] for res in ranks]


@pytest.mark.parametrize("mode", MODES)
def test_a_gan_and_a_distillation_train_like_one_process(ranks, plain, mode):
    """Losses of every step and every parameter of all four models match one process; the
    frozen teacher is unchanged; no gradient is left after the loops' ``zero_grad``."""
    results = _result(ranks, mode)
    want = torch.tensor(plain["losses"])
    assert want.shape == (STEPS, 3)
    for res in results:
        torch.testing.assert_close(torch.tensor(res["losses"]), want, rtol=1e-5, atol=1e-6)
        assert res["state"].keys() == plain["state"].keys()
        for name, value in plain["state"].items():
            torch.testing.assert_close(res["state"][name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name: f"{name}: {m}")
        assert res["grads_left"] == 0
    initial = {f"teacher.{n}": p for n, p in build()["teacher"].named_parameters()}
    for name, value in initial.items():
        assert torch.equal(results[0]["state"][name], value)
    # the discriminator and the generator moved: the loops trained something
    start = {f"{k}.{n}": p for k, m in build().items() for n, p in m.named_parameters()}
    assert not torch.equal(results[0]["state"]["disc.0.weight"], start["disc.0.weight"])
    assert not torch.equal(results[0]["state"]["gen.2.weight"], start["gen.2.weight"])
    if mode == "compiled":
        assert results[0]["graphs"] >= 4  # every model ran through its compiled graphs
