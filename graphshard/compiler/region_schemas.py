"""One schema per distinct block region while graphshard's backend compiles a step.

At each call of an ``invoke_subgraph`` region that needs gradients, torch checks that the
region does not mutate its operands: ``InvokeSubgraphHOP.gen_schema`` re-traces the region's
body to find out (torch 2.11 to 2.14), and AOTAutograd's tracing reaches every call about
three times. Every block of the model is a call of the same region, so one identical body is
traced again some 240 times for an 80-layer Llama: 11 s of the 43 s that ``graphshard plan
--model llama3-70b --world-size 1024`` took.

The schema depends only on the body and on each operand's kind: for a tensor its type,
dtype, device, shape, strides and ``requires_grad`` (the body is re-traced on fresh tensors
made from those, so operands that alias each other do not show), for anything else its
value; and on the dispatch keys and grad mode it is traced under. Within
:func:`cached_region_schemas` it is computed once per distinct key. Operands with symbolic
sizes, or values that cannot be hashed, are never cached.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["cached_region_schemas"]

# The caches of the compiles in progress (innermost last); empty outside them.
_ACTIVE: list[dict] = []


_UNKEYABLE = object()


def _operand_key(operand: Any) -> Any:
    """What of ``operand`` the schema depends on, or ``_UNKEYABLE``."""
    if isinstance(operand, torch.Tensor):
        sizes = (*operand.shape, *operand.stride())
        if not all(type(size) is int for size in sizes):
            return _UNKEYABLE  # symbolic sizes
        return (type(operand), operand.dtype, operand.device, tuple(operand.shape),
                operand.stride(), operand.requires_grad)
    return (type(operand), operand) if _hashable(operand) else _UNKEYABLE


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _schema_key(subgraph: Any, identifier: Any, operands: tuple) -> tuple | None:
    body = getattr(subgraph, "subgraph", subgraph)  # FunctionalizeCtxWrapper: a new one per call
    operand_keys = tuple(_operand_key(operand) for operand in operands)
    if _UNKEYABLE in operand_keys or not _hashable(identifier):
        return None
    return (id(body), identifier, operand_keys, torch.is_grad_enabled(),
            str(torch._C._dispatch_tls_local_include_set()),
            str(torch._C._dispatch_tls_local_exclude_set()))


def _install() -> bool:
    """Wrap ``InvokeSubgraphHOP.gen_schema`` (once per process) to answer from the active
    cache; outside :func:`cached_region_schemas` it runs torch's own unchanged."""
    try:
        from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
    except ImportError:
        return False
    original = InvokeSubgraphHOP.__dict__.get("gen_schema")
    if original is None:
        return False
    if getattr(original, "_graphshard_cached", False):
        return True

    def gen_schema(self: Any, subgraph: Any, identifier: Any, *operands: Any) -> Any:
        cache = _ACTIVE[-1] if _ACTIVE else None
        key = _schema_key(subgraph, identifier, operands) if cache is not None else None
        if key is None:
            return original(self, subgraph, identifier, *operands)
        hit = cache.get(key)
        if hit is None:
            body = getattr(subgraph, "subgraph", subgraph)
            # the body is kept alive with its schema, so its id is never reused meanwhile
            hit = cache[key] = (original(self, subgraph, identifier, *operands), body)
        return hit[0]

    gen_schema._graphshard_cached = True  # type: ignore[attr-defined]
    InvokeSubgraphHOP.gen_schema = gen_schema
    return True


@contextlib.contextmanager
def cached_region_schemas() -> Iterator[None]:
    """Within this block, each distinct region body's ``invoke_subgraph`` schema is computed
    once (see the module docstring); the cache is dropped at the exit."""
    if not _install():
        yield
        return
    _ACTIVE.append({})
    try:
        yield
    finally:
        _ACTIVE.pop()
