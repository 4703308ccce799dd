"""``regions_donate_no_inputs``: what it changes while graphshard runs Inductor, and that it
gives everything back (the generated code is checked in ``test_block_regions.py``)."""

from __future__ import annotations

import torch.compiler.config as compiler_config
from torch._inductor.graph import SubgraphLowering

from graphshard.compiler.region_donation import CACHE_TAG, regions_donate_no_inputs


def test_it_nests_keeps_the_users_tag_and_restores_torch():
    torchs_init = SubgraphLowering.__init__
    with compiler_config.patch(cache_key_tag="users-tag"):
        with regions_donate_no_inputs():
            assert SubgraphLowering.__init__ is not torchs_init
            assert compiler_config.cache_key_tag == f"users-tag|{CACHE_TAG}"
            with regions_donate_no_inputs():
                assert compiler_config.cache_key_tag == f"users-tag|{CACHE_TAG}"
            assert SubgraphLowering.__init__ is not torchs_init  # the outer one still holds
        assert compiler_config.cache_key_tag == "users-tag"
    assert SubgraphLowering.__init__ is torchs_init
    with regions_donate_no_inputs():
        assert compiler_config.cache_key_tag == CACHE_TAG
