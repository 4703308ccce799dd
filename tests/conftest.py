"""Test setup: one Inductor cache for the whole run, inherited by every spawned rank, no
calibrated hardware profile and no dump directory; the ``one_rank`` fixture (a real one-rank
gloo group in the test's own process) and ``fake2`` (a fake process group of 2, for tests
that look at graphs).

Suite time: a compiled test goes through Inductor only where Inductor's code is what it
checks. One Inductor compile of the tiny Llama costs about half a minute on 2 cores (g++ per
kernel, and Inductor's Python as much again); ``graphshard.backend(inductor=False)`` runs
the passes' graphs as they are, for about a quarter of that. Ranks that launch together
share one compile (``share_compiled``), so a launch costs what one rank compiles."""

import atexit
import os
import shutil
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".pytest_cache" / "inductor"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The cost model's built-in profiles only: a profile that `graphshard calibrate` saved on this
# machine (~/.cache/graphshard/profiles, or $GRAPHSHARD_PROFILE_DIR) would change the plans
# the tests expect. An empty directory of this run's own, removed at exit.
_PROFILES = tempfile.mkdtemp(prefix="graphshard-test-profiles-")
os.environ["GRAPHSHARD_PROFILE_DIR"] = _PROFILES
atexit.register(shutil.rmtree, _PROFILES, ignore_errors=True)
# Nor a dump directory of the user's: every compile would write its graphs there (and trace
# at once what AOTAutograd's cache answers); the dump tests set their own.
os.environ.pop("GRAPHSHARD_DUMP_DIR", None)
# On a small machine Inductor compiles in this process and in every rank's, not in a pool of
# worker processes: each pool worker imports torch anew, in every rank of every launch, and
# where the test workers and ranks already fill the cores that costs more than the pool saves
# (2 cores, a clean-clone suite: 15:45 against 21:24). A GPU machine keeps its pool for Triton.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
if (_CORES or 1) <= 4:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Records this environment as the one the ranks' fork server starts in (before any test runs).
import dist_utils  # noqa: E402,F401


@pytest.fixture
def one_rank():
    """A real one-rank gloo process group (a FileStore) in this process: a CPU-only run.
    Yields the default group; afterwards the group is destroyed and Dynamo reset."""
    import torch
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                                timeout=timedelta(seconds=60))
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()
            torch._dynamo.reset()


@pytest.fixture
def fake2():
    """A fake process group of 2 ranks in this process (graphs only: its collectives move
    nothing) and torch's seed 0; afterwards Dynamo is reset."""
    import torch
    from graph_utils import fake_process_group

    with fake_process_group(2):
        torch.manual_seed(0)
        yield
    torch._dynamo.reset()
