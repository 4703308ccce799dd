"""A parameter read outside ``forward`` by the loss, between forward and backward (a tied
output head applied by the loss), trains as one process does in the two documented ways
(``docs/api.md``): a method registered with ``register_forward_method``, or the sharded
parameter's ``full_tensor(grad_placements=[Partial("avg")])``. World 2, eager and compiled,
one launch (``outside_reads_jobs``)."""

from __future__ import annotations

import torch
from dist_utils import run_ranks


def test_a_head_applied_outside_forward_trains_like_one_process():
    import outside_reads_jobs as jobs

    ref_losses, ref_state = jobs.reference()
    ranks = run_ranks(jobs.run_modes, 2)
    assert set(ranks[0]) == {"method-eager", "method-compiled", "avg-eager", "avg-compiled"}
    for mode in ranks[0]:
        losses = (torch.stack(ranks[0][mode][0]) + torch.stack(ranks[1][mode][0])) / 2
        torch.testing.assert_close(losses, torch.stack(ref_losses), msg=mode)
        for name, value in ref_state.items():
            for r in ranks:
                torch.testing.assert_close(r[mode][1][name], value, msg=f"{mode} {name}")
