"""``graphshard plan``: what a model costs per rank and per step at world sizes no machine here has.

For each world size the real architecture is traced on fake tensors and a fake process group
and the compiler's own passes run on it (nothing allocated, nothing sent); the scheduled
graphs then give bucket count, per-rank memory, bytes per step and the cost model's
predicted step time.

With tensor parallelism (``tp > 1``) the world size counts all ranks, a ``(dp, tp)`` mesh:
graphshard shards over dp what tensor parallelism left on each rank, and every collective
of the graphs is attributed to a mesh dimension by its process group: graphshard's
all-gathers and reduce-scatters to dp, DTensor's all-reduces (and all-gathers,
reduce-scatters, all-to-alls) to tp.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch import fx

from graphshard.analysis.report import collectives_by_group, step_summary
from graphshard.errors import GraphshardValueError
from graphshard.passes.cost_model import get_profile
from graphshard.passes.markers import is_unshard, marker_args
from graphshard.passes.reshard import reshard_choice
from graphshard.passes.simulate import gathered_nodes, simulate
from graphshard.passes.traffic import step_traffic
from graphshard.tools.offline import Factory, trace_step_offline

__all__ = [
    "WhatIf",
    "what_if",
    "plan_one",
    "plan_many",
    "format_table",
    "format_reshard_choices",
    "symbolic_report",
    "llama_factory",
]

ADAM_STATES = 2  # exp_avg and exp_avg_sq, each the size of the sharded parameters


@dataclass
class WhatIf:
    """One world size: memory per rank (bytes), traffic per rank and step, predicted times (s).

    ``world_size`` = ``dp`` × ``tp`` ranks. Memory is per rank, from the traced graphs: the
    parameters tensor parallelism splits count 1/(dp·tp), the others 1/dp.
    ``bytes_per_step`` = ``dp_bytes_per_step`` + ``tp_bytes_per_step``; ``comm_s`` includes
    the tensor-parallel collectives (``tp_comm_s``), which the simulator puts on the one
    comm stream and the step waits for at once (not overlapped).
    """

    world_size: int
    buckets: int
    params: int  # Ψ: parameters graphshard shards over dp (per tp rank: TP-local shapes)
    params_regathered: int  # parameters the backward gathers again
    params_trained: int  # Ψ_g: of Ψ, those that take a gradient (a frozen one takes none)
    param_bytes: int  # bytes per parameter element (sharded master copy)
    sharded_params: int
    grads: int
    adam_state: int
    peak_unsharded: int
    activations: int
    bytes_per_step: int
    compute_s: float
    comm_s: float
    dp: int  # ranks graphshard shards across
    tp: int  # ranks of one tensor-parallel group
    model_params: int  # all parameters of the model
    tp_split_params: int  # of which tensor parallelism splits
    dp_bytes_per_step: int  # graphshard's all-gathers and reduce-scatters, per rank
    tp_bytes_per_step: int  # tensor parallelism's collectives, per rank
    tp_comm_s: float  # cost-model time of the tensor-parallel collectives
    predicted_step_s: float
    exposed_comm_s: float
    trace_s: float
    passes_s: float
    copy_bytes: int = 0  # bytes graphshard's own kernels move per step (passes.traffic)
    copy_floor_bytes: int = 0  # the least those kernels could move
    memory_budget: int | None = None  # --memory-budget: sharded with reshard="auto"
    # what reshard_after_forward="auto" chose, one ReshardChoice per compiled graph
    reshard_choices: list = field(default_factory=list)

    @property
    def memory_total(self) -> int:
        """All per-rank memory components added up."""
        return (
            self.sharded_params + self.grads + self.adam_state + self.peak_unsharded
            + self.activations
        )

    @property
    def bound_s(self) -> float:
        """The step cannot be faster than its compute or its communication."""
        return max(self.compute_s, self.comm_s)


def llama_factory(name: str, batch_size: int, seq_len: int, tp: int = 1) -> Factory:
    """A factory for a Llama preset of ``graphshard.models.llama`` with token inputs
    (``batch_size`` sequences per dp rank) and its tensor-parallel plan; ValueError if the
    preset does not split over ``tp`` ranks."""
    from graphshard.models.llama import (
        Llama,
        check_tensor_parallel,
        llama_config,
        tensor_parallel_plan,
    )

    check_tensor_parallel(llama_config(name), tp)

    def build():
        cfg = llama_config(name)
        tokens = (batch_size, min(seq_len, cfg.max_seq_len))
        model = Llama(cfg)
        return model, (torch.randint(0, cfg.vocab_size, tokens),), tensor_parallel_plan(model)

    return build


def resolve_factory(model: str, batch_size: int, seq_len: int, tp: int = 1) -> Factory:
    """A Llama preset name, or ``MODULE:FACTORY`` (a file in the current directory or an
    importable module), as a factory (a preset's is checked to split over ``tp`` ranks)."""
    if ":" in model:
        import sys
        from pathlib import Path

        from graphshard.tools.offline import load_factory

        sys.path.insert(0, str(Path.cwd()))
        return load_factory(model)
    return llama_factory(model, batch_size, seq_len, tp)


def plan_one(model: str, batch_size: int, seq_len: int, world_size: int, options: dict) -> WhatIf:
    """:func:`what_if` for a model named as on the command line (picklable: runs in workers)."""
    factory = resolve_factory(model, batch_size, seq_len, options.get("tp", 1))
    return what_if(factory, world_size, **options)


def plan_many(
    model: str, batch_size: int, seq_len: int, world_sizes: list[int], options: dict, jobs: int
) -> Iterator[WhatIf]:
    """:func:`plan_one` for each world size, ``jobs`` at a time in separate processes (each
    trace needs a process group of its own), yielded in order as they finish."""
    if jobs <= 1:
        for n in world_sizes:
            yield plan_one(model, batch_size, seq_len, n, options)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [
            pool.submit(plan_one, model, batch_size, seq_len, n, options) for n in world_sizes
        ]
        for future in futures:
            yield future.result()


def _markers(joint: fx.GraphModule) -> list[fx.Node]:
    seen, out = set(), []
    for node in joint.graph.nodes:
        if is_unshard(node) and marker_args(node).name not in seen:
            seen.add(marker_args(node).name)
            out.append(node)
    return out


def _nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _saved_activations(fw: fx.GraphModule, bw: fx.GraphModule) -> int:
    """Bytes the forward saves for backward, without shards and kept unsharded parameters
    (those count as parameters and peak unsharded). The saved values are the forward's last
    outputs, in the order of the backward's non-gradient inputs."""
    saved = [n for n in bw.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    outputs = fw.graph.find_nodes(op="output")[0].args[0]
    produced = outputs[len(outputs) - len(saved):] if saved else []
    parameters = gathered_nodes(fw.graph)
    return sum(
        _nbytes(node)
        for node in produced
        if isinstance(node, fx.Node) and node.op != "placeholder" and node not in parameters
    )


def _regathered(bw: fx.GraphModule) -> set[str]:
    """Names of the parameters the backward graph gathers again."""
    names: set[str] = set()
    for node in bw.graph.nodes:
        tag = node.meta.get("graphshard")
        if tag and tag["kind"] == "unshard":
            names.update(tag["params"])
    return names


def what_if(
    factory: Factory, world_size: int, *, profile: str, tp: int = 1,
    shard_options: dict | None = None, **plan_options
) -> WhatIf:
    """Trace ``factory()`` at ``world_size`` fake ranks (``world_size // tp`` × ``tp``) and
    size up one training step. With ``memory_budget`` the model is sharded with
    ``reshard_after_forward="auto"`` and the choice per bucket is in ``reshard_choices``;
    ``shard_options`` are other ``graphshard.shard`` options (``reshard_after_forward=8``)."""
    start = time.perf_counter()
    budget = plan_options.get("memory_budget")
    if budget is not None:
        shard_options = {**(shard_options or {}), "reshard_after_forward": "auto"}
    trace = trace_step_offline(factory, world_size, tp=tp, profile=profile,
                               shard_options=shard_options, **plan_options)
    trace_s = time.perf_counter() - start
    graphs = trace.graphs
    hw = get_profile(profile)
    summary = step_summary(graphs, hw)
    copies = step_traffic(graphs)
    per_dim = _per_dimension(collectives_by_group(graphs, hw), trace.groups)
    markers = [m for stages in graphs for m in _markers(stages["joint"])]
    params = sum(math.prod(marker_args(m).full_shape) for m in markers)
    shard_bytes = sum(_nbytes(marker_args(m).shard) for m in markers)
    trained = [m for m in markers if marker_args(m).name not in trace.frozen]
    trained_bytes = sum(_nbytes(marker_args(m).shard) for m in trained)
    elem = markers[0].meta["val"].element_size() if markers else 4
    buckets = {marker_args(m).bucket for m in markers}
    compute = comm = 0.0
    activations = regathered = 0
    for stages in graphs:
        for stage in ("fw", "bw"):
            timeline = simulate(stages[stage], hw)
            compute += timeline.compute_time
            comm += timeline.comm_time
        activations += _saved_activations(stages["fw"], stages["bw"])
        names = _regathered(stages["bw"])
        regathered += sum(
            math.prod(marker_args(m).full_shape) for m in _markers(stages["joint"])
            if marker_args(m).name in names
        )
    return WhatIf(
        world_size=world_size,
        dp=trace.dp,
        tp=trace.tp,
        model_params=trace.model_params,
        tp_split_params=trace.tp_split_params,
        buckets=len(buckets),
        params=params,
        params_regathered=regathered,
        params_trained=sum(math.prod(marker_args(m).full_shape) for m in trained),
        param_bytes=elem,
        sharded_params=shard_bytes,
        grads=trained_bytes,  # a frozen parameter has no gradient and no optimizer state
        adam_state=ADAM_STATES * trained_bytes,
        peak_unsharded=summary["peak_unsharded_bytes"],
        activations=activations,
        bytes_per_step=per_dim["dp"]["bytes"] + per_dim["tp"]["bytes"],
        dp_bytes_per_step=per_dim["dp"]["bytes"],
        tp_bytes_per_step=per_dim["tp"]["bytes"],
        compute_s=compute,
        comm_s=comm,
        tp_comm_s=per_dim["tp"]["seconds"],
        predicted_step_s=summary["predicted_step_s"],
        exposed_comm_s=summary["predicted_exposed_comm_s"],
        trace_s=trace_s,
        passes_s=trace.pass_seconds,
        copy_bytes=copies.total,
        copy_floor_bytes=copies.total_minimum,
        memory_budget=None if budget is None else next(
            (c.budget for s in graphs if (c := reshard_choice(s["joint"])) is not None), None),
        reshard_choices=[c for s in graphs if (c := reshard_choice(s["joint"])) is not None],
    )


def _per_dimension(by_group: dict[str, dict], groups: dict[str, str]) -> dict[str, dict]:
    """Bytes (rounded to whole bytes) and seconds of the collectives per mesh dimension."""
    unknown = sorted(set(by_group) - set(groups))
    if unknown:
        raise GraphshardValueError(
            f"collectives on process group(s) {unknown}, which are neither the dp nor the tp "
            f"dimension of the traced mesh ({groups}): cannot attribute their traffic"
        )
    out = {dim: {"bytes": 0.0, "seconds": 0.0} for dim in ("dp", "tp")}
    for name, group in by_group.items():
        out[groups[name]]["bytes"] += group["bytes"]
        out[groups[name]]["seconds"] += group["seconds"]
    for dim in out.values():
        dim["bytes"] = int(round(dim["bytes"]))
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def format_table(rows: list[WhatIf]) -> str:
    """A markdown table, one row per world size (N = dp × tp ranks).

    ``bytes/step`` is all a rank sends in a step: ``dp bytes/step`` (graphshard's gathers and
    reduce-scatters) plus ``tp bytes/step`` (tensor parallelism's collectives); ``comm s``
    includes ``tp comm s``. ``copies GiB (floor)`` is what graphshard's own kernels move per
    step and rank (copy-in, casts, padding, copy-out, interleave, gradients into the
    reduce-scatter buffer, as Inductor fuses them; :mod:`graphshard.passes.traffic`), with
    the least they could move in brackets.
    """
    head = (
        "| N | dp x tp | buckets | params GiB | grads GiB | Adam GiB | peak unsharded GiB"
        " | activations GiB | total GiB | bytes/step GiB | dp bytes/step GiB"
        " | tp bytes/step GiB | compute s | comm s | tp comm s | predicted s"
        " | exposed comm s | bound s | copies GiB (floor) | trace s | passes s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r.world_size} | {r.dp} x {r.tp} | {r.buckets} | {_gib(r.sharded_params)} | "
            f"{_gib(r.grads)} | {_gib(r.adam_state)} | {_gib(r.peak_unsharded)} | "
            f"{_gib(r.activations)} | {_gib(r.memory_total)} | {_gib(r.bytes_per_step)} | "
            f"{_gib(r.dp_bytes_per_step)} | {_gib(r.tp_bytes_per_step)} | {r.compute_s:.4f} | "
            f"{r.comm_s:.4f} | {r.tp_comm_s:.4f} | {r.predicted_step_s:.4f} | "
            f"{r.exposed_comm_s:.4f} | {r.bound_s:.4f} | "
            f"{_gib(r.copy_bytes)} ({_gib(r.copy_floor_bytes)}) | {r.trace_s:.1f} | "
            f"{r.passes_s:.1f} |"
        )
    return "\n".join(lines) + "\n"


def format_reshard_choices(rows: list[WhatIf]) -> str:
    """Per world size and compiled graph: what ``reshard_after_forward="auto"`` chose within
    the memory budget (keep or free per bucket) and the predicted peak per rank."""
    lines = []
    for r in rows:
        for i, choice in enumerate(r.reshard_choices):
            graph = f", graph {i}" if len(r.reshard_choices) > 1 else ""
            unread = f", {len(choice.unread)} not read in backward" if choice.unread else ""
            lines += [f"N={r.world_size}{graph}: kept {len(choice.kept)} bucket(s) for backward"
                      f" (ZeRO-2), freed {len(choice.freed)} (ZeRO-3){unread}", choice.format(),
                      ""]
    return "\n".join(lines)


def symbolic_report(rows: list[WhatIf]) -> str:
    """Bytes per step and per-rank memory as formulas in N (sympy), checked against ``rows``.

    Bytes per rank and step: the forward gathers Ψ parameters, the backward gathers again the
    Ψ_bw it needs, the reduce-scatter moves the gradients of the Ψ_g that take one (Ψ but
    the frozen ones); a ring sends (N-1)/N of each. The classic ZeRO-3 figure
    (N-1)/N·Ψ·(2·b_param + b_reduce) is the case Ψ_bw = Ψ_g = Ψ. Padding of dim 0 to a
    multiple of N is the only other difference, and it is shown.

    With tensor parallelism N is the dp degree, Ψ what one tp rank holds, and the formula
    covers the dp bytes only (the tp bytes depend on activations, not parameters).
    """
    import sympy as sp

    N, psi, psi_bw, psi_g, bp, br = sp.symbols("N Psi Psi_bw Psi_g b_param b_reduce",
                                               positive=True)
    frozen = any(r.params_trained != r.params for r in rows)
    trained = psi_g if frozen else psi  # the formulas name Psi_g only where it differs
    traffic = (N - 1) / N * (psi * bp + psi_bw * bp + trained * br)
    zero3 = (N - 1) / N * psi * (2 * bp + br)
    # params, and for the trained ones grads + Adam (2 states), all sharded
    state = psi / N * bp + trained / N * (bp + 2 * bp)
    tensor_parallel = any(r.tp > 1 for r in rows)
    lines = [
        f"bytes per rank and step = {sp.simplify(traffic)}",
        f"  (ZeRO-3 textbook, Psi_bw = Psi: {sp.factor(zero3)})",
        f"sharded state per rank (params, grads, Adam) = {sp.simplify(state)}"
        "  (+ padding, + peak unsharded, + activations)",
        *(["with tensor parallelism: N = dp ranks, Psi = parameters per tp rank, bytes = dp "
           "bytes only"] if tensor_parallel else []),
        *(["Psi_g: the parameters that take a gradient (frozen ones take none)"]
          if frozen else []),
        "",
        f"| {'N (dp)' if tensor_parallel else 'N'} | Psi | Psi_bw | formula bytes | graph bytes "
        "| rel. diff (padding) | formula state | graph state |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        subs = {N: r.dp or r.world_size, psi: r.params, psi_bw: r.params_regathered,
                psi_g: r.params_trained, bp: r.param_bytes, br: r.param_bytes}
        expected = float(traffic.subs(subs))
        state_expected = float(state.subs(subs))
        state_graph = r.sharded_params + r.grads + r.adam_state
        diff = (r.dp_bytes_per_step - expected) / expected if expected else 0.0
        lines.append(
            f"| {subs[N]} | {r.params:,} | {r.params_regathered:,} | {expected:,.0f} | "
            f"{r.dp_bytes_per_step:,} | {diff:+.2e} | {state_expected:,.0f} | {state_graph:,} |"
        )
    return "\n".join(lines) + "\n"


def rows_as_dicts(rows: list[WhatIf]) -> list[dict]:
    """Rows for JSON, with the derived totals."""
    return [asdict(r) | {"memory_total": r.memory_total, "bound_s": r.bound_s} for r in rows]
