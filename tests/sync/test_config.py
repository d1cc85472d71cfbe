"""``replica_sync=`` is checked where the strategy is built, with a message that says what to change."""

from __future__ import annotations

import pytest

from lightning_clapping import ClappingStrategy, DiLoCo, LAG
from lightning_clapping.sync.config import resolve


def test_mode_names_and_config_dicts_give_the_modes_with_their_constants():
    assert resolve("lag") == LAG(threshold=1.0, memory=10)  # the paper's D = 10, xi_d = 1 / D
    assert resolve({"mode": "diloco", "inner_steps": 8}) == DiLoCo(inner_steps=8)
    assert resolve(None).name == "every-step"


@pytest.mark.parametrize("value, words", [
    ("lazy", "is not a mode"),
    (DiLoCo(inner_steps=0), "inner_steps >= 1"),
    (DiLoCo(inner_steps=4, fragments=5), "fragments <= inner_steps"),
    (DiLoCo(codec="q3x"), "is not a codec"),
    (LAG(memory=0), "memory >= 1"),
    (LAG(reference="grad"), "'steps' \\(the paper's\\) or 'average'"),
    (3, "must be 'every-step'"),
])
def test_bad_settings_are_refused_naming_the_setting(value, words):
    with pytest.raises((ValueError, TypeError), match=words):
        ClappingStrategy(replica_sync=value)


def test_a_sync_mode_with_a_ddp_communication_hook_is_refused():
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    with pytest.raises(ValueError, match="takes no ddp_comm_hook"):
        ClappingStrategy(replica_sync="diloco", ddp_comm_hook=bf16_compress_hook)


@pytest.mark.parametrize("value, words", [
    ("lag", "replica_sync='lag' cannot run with fault_tolerance: every replica reuses a stale sum"),
    (DiLoCo(codec="q4"), "torchft's quorum gives an all-reduce only"),
])
def test_fault_tolerance_refuses_the_modes_it_cannot_keep_whole(value, words):
    pytest.importorskip("torchft")
    with pytest.raises(ValueError, match=words):
        ClappingStrategy(replica_sync=value, fault_tolerance="torchft")


def test_fault_tolerance_takes_diloco_without_a_codec():
    pytest.importorskip("torchft")
    strategy = ClappingStrategy(replica_sync=DiLoCo(inner_steps=4), fault_tolerance="torchft")
    assert strategy.options.replica_sync == DiLoCo(inner_steps=4)
