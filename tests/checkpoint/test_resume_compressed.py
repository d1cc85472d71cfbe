"""A run stopped and resumed continues exactly as if never stopped: compressed with lazy sampling (stopped
mid-window), and uncompressed, with full and with sharded checkpoints."""

from __future__ import annotations

import json

import pytest

from lightning_clapping.comm.wire import HEADER_BYTES
from conftest import launch_forked


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """``resumed(variant, state_dict_type)``: the uninterrupted run's rows and the resumed run's rows. The run that
    stops at step 8 shares its launch with the variant's uninterrupted run, which is made once for both checkpoint
    types (it saves no checkpoint, so the type does not change it); the resumed run starts new processes."""
    out = tmp_path_factory.mktemp("resume")
    uninterrupted = {}

    def runs(variant, state_dict_type):
        modes = "first" if variant in uninterrupted else "full,first"
        launch_forked("resume_run.py", str(out), modes, variant, state_dict_type, ranks=3, cwd=out)
        uninterrupted.setdefault(variant, out / f"full_{variant}_{state_dict_type}.json")
        launch_forked("resume_run.py", str(out), "rest", variant, state_dict_type, ranks=3, cwd=out)
        full = json.loads(uninterrupted[variant].read_text())
        first = json.loads((out / f"first_{variant}_{state_dict_type}.json").read_text())
        rest = json.loads((out / f"rest_{variant}_{state_dict_type}.json").read_text())
        assert len(full) == 14 and len(first) == 8 and len(rest) == 6
        assert first[:7] == full[:7] and first[7][0] == full[7][0]  # a run's last step has no numbers logged after it
        return full, rest

    return runs


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_compressed_resume_mid_window_reproduces_decisions_bytes_and_losses(resumed, state_dict_type):
    full, rest = resumed("clapping-fc", state_dict_type)
    assert full[8][1] == 0.0, "step 8 must reuse step 7's batch: the checkpoint falls inside a reuse window"
    # same fresh/reuse decisions and exactly the same losses (feedback buffers and sampler state restored)
    assert [r[1] for r in rest] == [r[1] for r in full[8:]]
    assert [r[0] for r in rest] == [r[0] for r in full[8:]]
    # the same bytes, except that the new processes announce each slot's message size once (a header-sized
    # message per slot: 2 boundaries x 2 directions x 4 micro-batches)
    assert rest[0][2] - full[8][2] == 16 * HEADER_BYTES
    assert [r[2] for r in rest[1:]] == [r[2] for r in full[9:]]


def test_uncompressed_sharded_resume_reproduces_losses(resumed):
    full, rest = resumed("uncompressed", "sharded")
    assert [r[0] for r in rest] == [r[0] for r in full[8:]]
