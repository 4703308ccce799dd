"""Readable dumps of every graph before and after every pass.

Layout: ``DIR/rank{R}/graph{G}/{stage}_{NN}_{pass}.txt`` where G counts the graphs this
process compiled, stage is ``dynamo``, ``joint``, ``fw``, ``bw`` or ``inference``, and NN
orders the passes (00 is the graph as it arrived).
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import fx

__all__ = ["GraphDumper", "dump_dir_from_env"]

ENV_VAR = "GRAPHSHARD_DUMP_DIR"


def dump_dir_from_env() -> str | None:
    """The dump directory set by ``GRAPHSHARD_DUMP_DIR``, if any."""
    return os.environ.get(ENV_VAR) or None


class GraphDumper:
    """Writes the graphs of one compiled graph on one rank; does nothing without a directory."""

    def __init__(self, root: str | os.PathLike | None, graph_id: int, rank: int) -> None:
        self.dir = None if root is None else Path(root) / f"rank{rank}" / f"graph{graph_id:03d}"

    @property
    def enabled(self) -> bool:
        """Whether anything is written."""
        return self.dir is not None

    def write(self, stage: str, step: int, name: str, gm: fx.GraphModule) -> None:
        """Write ``gm`` as readable Python-like code under ``{stage}_{step:02d}_{name}.txt``."""
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        text = gm.print_readable(print_output=False, include_stride=False, include_device=False)
        (self.dir / f"{stage}_{step:02d}_{name}.txt").write_text(text)
