"""Fixtures of the CUDA tier: one process group per test module, in the pytest process.

``nccl_world``: a real one-rank group (``cpu:gloo,cuda:nccl``). ``fake_world8``: rank 0 of
``bench.fake_world``'s CUDA fake world of 8. Each module uses one of them, so each module
sets its group up once and tears it down before the next module starts its own. The
Inductor cache is the session's (``tests/conftest.py``).
"""

from __future__ import annotations

import pytest
from gpu_harness import fake_world, world1


@pytest.fixture(scope="module")
def nccl_world():
    with world1("cuda") as world:
        yield world


@pytest.fixture(scope="module")
def fake_world8():
    with fake_world(8, "cuda") as world:
        yield world
