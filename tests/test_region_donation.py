"""``graphshard.safety.region_donation``: the cache tag within graphshard's compiles, and the
process-wide patch of torch's region lowering (the generated code is checked in
``test_block_regions.py``, the numerics in ``test_parity.py``)."""

from __future__ import annotations

import torch.compiler.config as compiler_config
from torch._inductor.graph import SubgraphLowering

from graphshard.safety import region_donation
from graphshard.safety.region_donation import CACHE_TAG, regions_donate_no_inputs


def test_the_tag_nests_keeps_the_users_and_goes_away():
    with compiler_config.patch(cache_key_tag="users-tag"):
        with regions_donate_no_inputs():
            assert compiler_config.cache_key_tag == f"users-tag|{CACHE_TAG}"
            with regions_donate_no_inputs():
                assert compiler_config.cache_key_tag == f"users-tag|{CACHE_TAG}"
            assert compiler_config.cache_key_tag == f"users-tag|{CACHE_TAG}"
        assert compiler_config.cache_key_tag == "users-tag"
    with regions_donate_no_inputs():
        assert compiler_config.cache_key_tag == CACHE_TAG


def test_the_lowering_is_patched_once_and_for_good(monkeypatch):
    monkeypatch.setattr(region_donation.REGIONS_DONATE_NO_INPUTS, "_applied", False)
    monkeypatch.setattr(SubgraphLowering, "__init__", SubgraphLowering.__init__)
    if hasattr(SubgraphLowering.__init__, "torch_init"):
        # an earlier test installed block regions: start again from torch's own lowering
        monkeypatch.setattr(SubgraphLowering, "__init__", SubgraphLowering.__init__.torch_init)
    torchs_own = SubgraphLowering.__init__
    region_donation.regions_donate_no_inputs_in_this_process()
    patched = SubgraphLowering.__init__
    assert patched.torch_init is torchs_own
    region_donation.regions_donate_no_inputs_in_this_process()  # idempotent
    with regions_donate_no_inputs():
        assert SubgraphLowering.__init__ is patched
    assert SubgraphLowering.__init__ is patched  # for good
