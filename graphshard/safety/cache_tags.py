"""Tags on Inductor's FX-graph cache keys for graphshard's patches of torch's lowering.

Inductor's cache keys cover its config and the graph, not a patch of its code: an entry
compiled before a patch would be loaded under it. Each patch of the lowering that graphshard
applies adds a tag of its own to ``torch.compiler.config.cache_key_tag`` while graphshard's
backend compiles, so that no such entry is a hit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["cache_keys_tagged"]


@contextlib.contextmanager
def cache_keys_tagged(tag: str) -> Iterator[None]:
    """Within: ``torch.compiler.config.cache_key_tag`` holds ``tag`` beside the user's own
    (once, however deeply nested)."""
    import torch.compiler.config as compiler_config

    current = compiler_config.cache_key_tag
    if tag not in current:
        current = f"{current}|{tag}" if current else tag
    with compiler_config.patch(cache_key_tag=current):
        yield
