"""Offloaded gradients go to the host on a copy stream, waited for once per graph.

Under CPU offload each bucket's reduced gradients are copied to the host
(``graphshard::to_host``, inserted by ``lower_reduce_grad``). Left there, every copy runs on
the compute stream and is waited for, so the backward stops the host at every bucket, and
the copy holds the compute stream while it crosses the bus, in series with the host-to-device
copies of the next buckets' gathers. On an H100 (llama-1b, bf16) a step's 13.3 GB over PCIe
took about as long as all of them in series (docs/cpu-offload.md); FSDP2 copies gradients on
a stream of its own.

With ``Plan.grad_copy_stream`` (on by default) the copies of the backward run on a copy stream
(:mod:`graphshard.passes.host_copy`):

- a copy whose result the graph only views (slices, reshapes) on its way to the output is
  issued and not waited for on the host (``wait=False``). At most two buckets' such copies
  run at once (a bucket is one copy at world > 1, one per parameter at world 1): a
  bucket's first copy lists the copies of the bucket two before it, and their device
  sources, as ``retire``, so the compute stream waits there for those copies (events, no
  host stop) and the sources' memory may be reused after that point. The operands keep
  the sources alive until then: Inductor's buffer reuse knows one stream only;
- every other copy waits on the host, for itself and for the copies issued before it on that
  stream, and takes as ``issued`` operands, which it does not read, the copies still running
  (so that no scheduler moves it before them) and their device sources (alive until then).
  The graph's last copy is always one of these, so every gradient is on the host when the
  graph returns.

Only the graph's views touch a copy that is not waited for, and a view reads no data, so no
host code reads a gradient before its copy has finished. The price: two buckets' reduced
gradients stay on the device until their copies are done, where copies on the compute stream
free each bucket's after its copy; the compute stream stops at a bucket only if the copy two
buckets back has not finished by then. On an H200 (2026-12-04) the compiled offload step with
both copy streams took 0.84x FSDP2's; on the CPU every copy is synchronous whatever it is
asked.
"""

from __future__ import annotations

from torch import fx

from graphshard.passes.fx_util import is_view
from graphshard.passes.host_copy import TO_HOST
from graphshard.passes.plan import Plan

__all__ = ["grad_copy_stream"]


def _only_viewed_to_the_output(node: fx.Node) -> bool:
    """Whether every use of ``node`` is the graph's output or a view used only so."""
    pending = list(node.users)
    while pending:
        user = pending.pop()
        if user.op == "output":
            continue
        if not is_view(user):
            return False
        pending.extend(user.users)
    return True


# Buckets whose copies are left running at once: a bucket's first copy retires the copies of
# the bucket this many buckets before it.
IN_FLIGHT = 2


def grad_copy_stream(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Put the backward's device-to-host gradient copies on the copy stream, at most
    ``IN_FLIGHT`` buckets' running at once, waiting on the host only where the graph reads a
    copy and at the last one (module docstring)."""
    if not plan.grad_copy_stream:
        return gm
    copies = [node for node in gm.graph.find_nodes(op="call_function", target=TO_HOST)
              if node.meta.get("graphshard_copy", {}).get("direction") == "d2h"]
    running: list[list[fx.Node]] = []  # per bucket, oldest first: copies not yet retired
    for k, copy in enumerate(copies):
        last = k == len(copies) - 1
        bucket = copy.meta["graphshard_copy"]["bucket"]
        if not last and _only_viewed_to_the_output(copy):
            retire: list[fx.Node] = []
            if not running or running[-1][0].meta["graphshard_copy"]["bucket"] != bucket:
                while len(running) >= IN_FLIGHT:  # a new bucket: retire the oldest's copies
                    for oldest in running.pop(0):
                        retire += [oldest, oldest.args[0]]  # result (event), source (life)
                running.append([])
            copy.kwargs = {**copy.kwargs, "wait": False,
                           **({"retire": retire} if retire else {})}
            running[-1].append(copy)
        else:  # the copies (its order) and their device sources (their lifetime)
            flat = [c for group in running for c in group]
            copy.kwargs = {**copy.kwargs, "wait": True,
                           "issued": flat + [c.args[0] for c in flat]}
            running = []
    gm.graph.lint()
    gm.recompile()
    return gm
