"""A compressed run with lazy sampling, stopped mid-window and resumed, continues exactly as if never stopped."""

from __future__ import annotations

import json

from lightning_clapping.channel import HEADER_BYTES
from conftest import launch


def test_resume_mid_window_reproduces_decisions_bytes_and_losses(tmp_path):
    for mode in ("full", "first", "rest"):
        launch("resume_run.py", str(tmp_path), mode, cwd=tmp_path)
    full = json.loads((tmp_path / "full.json").read_text())
    first = json.loads((tmp_path / "first.json").read_text())
    rest = json.loads((tmp_path / "rest.json").read_text())
    assert len(full) == 14 and len(first) == 8 and len(rest) == 6
    assert first == full[:8]
    assert full[8][1] == 0.0, "step 8 must reuse step 7's batch: the checkpoint falls inside a reuse window"
    # same fresh/reuse decisions and exactly the same losses (feedback buffers and sampler state restored)
    assert [r[1] for r in rest] == [r[1] for r in full[8:]]
    assert [r[0] for r in rest] == [r[0] for r in full[8:]]
    # the same bytes, except that the new processes announce each slot's message size once (a header-sized
    # message per slot: 2 boundaries x 2 directions x 4 micro-batches)
    assert rest[0][2] - full[8][2] == 16 * HEADER_BYTES
    assert [r[2] for r in rest[1:]] == [r[2] for r in full[9:]]
