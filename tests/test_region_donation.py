"""``regions_donate_no_inputs``: what it changes while graphshard runs Inductor, and that it
gives everything back; the process-wide form that installing block regions applies (the
generated code is checked in ``test_block_regions.py``)."""

from __future__ import annotations

import torch.compiler.config as compiler_config
from torch._inductor.graph import SubgraphLowering

from graphshard.safety import region_donation
from graphshard.safety.region_donation import CACHE_TAG, regions_donate_no_inputs


def _patched() -> bool:
    return getattr(SubgraphLowering.__init__, "donates_no_inputs", False)


def test_it_nests_keeps_the_users_tag_and_restores_what_was_there(monkeypatch):
    # as in a process where no block regions were installed (they patch for good)
    monkeypatch.setattr(region_donation, "_process_wide", False)
    monkeypatch.setattr(region_donation, "_depth", 0)
    monkeypatch.setattr(region_donation, "_original_init", region_donation._original_init)
    monkeypatch.setattr(SubgraphLowering, "__init__", SubgraphLowering.__init__)
    before = SubgraphLowering.__init__
    with compiler_config.patch(cache_key_tag="users-tag"):
        with regions_donate_no_inputs():
            assert _patched()
            assert compiler_config.cache_key_tag == f"users-tag|{CACHE_TAG}"
            with regions_donate_no_inputs():
                assert compiler_config.cache_key_tag == f"users-tag|{CACHE_TAG}"
            assert _patched()  # the outer one still holds
        assert compiler_config.cache_key_tag == "users-tag"
    assert SubgraphLowering.__init__ is before
    with regions_donate_no_inputs():
        assert compiler_config.cache_key_tag == CACHE_TAG


def test_the_process_wide_form_outlives_a_context(monkeypatch):
    monkeypatch.setattr(region_donation, "_process_wide", False)
    monkeypatch.setattr(region_donation, "_depth", 0)
    monkeypatch.setattr(region_donation, "_original_init", region_donation._original_init)
    monkeypatch.setattr(SubgraphLowering, "__init__", SubgraphLowering.__init__)
    if _patched():  # an earlier test installed block regions: start from torch's own
        monkeypatch.setattr(SubgraphLowering, "__init__", region_donation._original_init)
    assert not _patched()
    region_donation.regions_donate_no_inputs_in_this_process()
    region_donation.regions_donate_no_inputs_in_this_process()  # idempotent
    with regions_donate_no_inputs():
        assert _patched()
    assert _patched() and region_donation._depth == 1
