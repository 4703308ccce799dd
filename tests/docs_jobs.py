"""The Python examples of README.md and docs/*.md, and the ranks that run them (test_docs.py).

A fenced block whose info string is ``python`` plus tags is an example:

- ``python runnable``: run on 2 gloo ranks (one launch of rank processes for every block).
  A block that calls ``init_process_group`` is a complete program: it runs with torchrun's
  environment set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and no
  process group. Any other block runs with the default process group already up and these
  names defined (see :func:`setup`): ``torch``, ``dist``, ``graphshard``, ``rank``,
  ``world_size``, ``init_device_mesh``, ``model`` (the tiny Llama, seeded, sharded),
  ``opt`` (AdamW over it), ``tokens`` (a batch of this rank's tokens), ``tmp`` (a directory
  every rank shares).
- ``python gpu`` / ``python download``: needs a GPU or a download; only compiled.
- plain ``python``: a fragment; only compiled.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TAGS = {"runnable", "gpu", "download"}


def doc_files() -> list[Path]:
    """README.md and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    tags: tuple[str, ...]
    source: str

    @property
    def name(self) -> str:
        return f"{self.path}:{self.line}"


def python_blocks() -> list[Block]:
    """Every fenced ``python`` block of the docs, with its tags."""
    blocks = []
    for path in doc_files():
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            match = re.match(r"^(`{3,})\s*(\S*)(.*)$", lines[i])
            if not match:
                i += 1
                continue
            fence, lang, rest = match.groups()
            end = i + 1
            while end < len(lines) and not lines[end].startswith(fence):
                end += 1
            if lang == "python":
                blocks.append(Block(str(path.relative_to(ROOT)), i + 1, tuple(rest.split()),
                                    "\n".join(lines[i + 1:end]) + "\n"))
            i = end + 1
    return blocks


def is_program(block: Block) -> bool:
    return "init_process_group(" in block.source


def setup(rank: int, world_size: int, tmp: str) -> dict:
    """The names a runnable block that is not a complete program may use."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import graphshard
    from graphshard.models.data import SyntheticTokens
    from graphshard.models.llama import Llama, llama_config

    torch.manual_seed(0)
    model = graphshard.shard(Llama(llama_config("tiny")))
    return dict(
        torch=torch, dist=dist, graphshard=graphshard, rank=rank, world_size=world_size,
        init_device_mesh=init_device_mesh, model=model,
        opt=torch.optim.AdamW(model.parameters(), lr=1e-3),
        tokens=SyntheticTokens(256, seed=0).batch(0, rank, batch_size=2, seq_len=16),
        tmp=tmp,
    )


def run_blocks_rank(rank: int, world_size: int, blocks: list[Block], out_dir: str) -> None:
    """One rank: every block in order, each with its own process group; writes
    ``rank{R}.pt``, a list of (block name, seconds)."""
    import time

    import torch.distributed as dist
    from dist_utils import run_port

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1")
    times = []
    for index, block in enumerate(blocks):
        os.environ["MASTER_PORT"] = str(run_port(out_dir, index, rank))
        torch._dynamo.reset()
        tmp = Path(out_dir) / f"block{index}"
        start = time.perf_counter()
        try:
            if is_program(block):
                namespace = {"__name__": "__main__"}
            else:
                dist.init_process_group("gloo")
                tmp.mkdir(exist_ok=True)
                dist.barrier()
                namespace = {"__name__": "__main__", **setup(rank, world_size, str(tmp))}
            code = compile(block.source, block.name, "exec")
            try:
                exec(code, namespace)
            except Exception as error:
                raise AssertionError(f"{block.name} failed on rank {rank}: {error!r}") from error
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        times.append((block.name, time.perf_counter() - start))
    torch.save(times, Path(out_dir) / f"rank{rank}.pt")


def run_blocks(blocks: list[Block], world_size: int = 2) -> list[list[tuple[str, float]]]:
    """Run ``blocks`` on ``world_size`` ranks in one launch of rank processes."""
    from dist_utils import start_ranks

    with tempfile.TemporaryDirectory() as tmp:
        start_ranks(run_blocks_rank, world_size, world_size, blocks, tmp)
        return [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(world_size)]


def from_fsdp2_rank(rank: int, world_size: int, runs: list[list[str]], out_dir: str) -> None:
    """One rank: ``examples/from_fsdp2.py``'s ``main`` once per argv in ``runs``; writes
    ``rank{R}.pt``, the list of each run's losses."""
    import importlib.util

    from dist_utils import run_port

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("from_fsdp2", ROOT / "examples" / "from_fsdp2.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1")
    results = []
    for index, argv in enumerate(runs):
        os.environ["MASTER_PORT"] = str(run_port(out_dir, index, rank))
        torch._dynamo.reset()
        results.append(example.main(argv))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def run_from_fsdp2(*argvs: list[str], world_size: int = 2) -> list[list[float]]:
    """Rank 0's losses of each run of ``examples/from_fsdp2.py``, in one launch."""
    from dist_utils import start_ranks

    with tempfile.TemporaryDirectory() as tmp:
        runs = [[a.replace("{tmp}", tmp) for a in argv] for argv in argvs]
        start_ranks(from_fsdp2_rank, world_size, world_size, runs, tmp)
        return torch.load(Path(tmp) / "rank0.pt")
