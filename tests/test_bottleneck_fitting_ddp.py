"""FitBottlenecks under Lightning's DDP strategy: the processes fit on batches of their own, and every replica starts
from the same weights: those one process fits on all the processes' batches (as ClappingStrategy's replicas do)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import SCRIPTS, launch_forked

sys.path.insert(0, str(SCRIPTS))


def _ddp_fit(out: str, mode: str) -> None:
    import lightning as L
    from fit_bottlenecks_run import FitMLP, Record, batches, data

    from lightning_clapping import FitBottlenecks

    L.seed_everything(0, verbose=False)
    model = FitMLP()
    rank = int(os.environ["LOCAL_RANK"])  # process r fits on batches 2r and 2r + 1 of four (lopsided: 1 gets none)
    mine = batches(n=4)[2 * rank:2 * rank + 2] if mode == "ddp" or rank == 0 else []
    fit, record = FitBottlenecks(mine, positions=lambda b: b[1]), {}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[fit, Record(record, fit)])
    trainer.fit(model, data(8))
    Path(out, f"{mode}_{trainer.global_rank}.json").write_text(json.dumps(record))


@pytest.mark.parametrize("mode, fitted", [("ddp", slice(0, 4)), ("lopsided", slice(0, 2))])
def test_ddp_replicas_fit_on_all_their_batches_and_start_from_the_same_weights(tmp_path, mode, fitted):
    from fit_bottlenecks_run import FitMLP, batches

    import lightning as L

    from lightning_clapping import fit_bottlenecks

    launch_forked(_ddp_fit, str(tmp_path), mode, ranks=2, cwd=tmp_path, timeout=200)
    ranks = [json.loads((tmp_path / f"{mode}_{r}.json").read_text()) for r in (0, 1)]
    L.seed_everything(0, verbose=False)
    model = FitMLP()
    kept = fit_bottlenecks(model, batches(n=4)[fitted], run=lambda b: model.net(b[0]), positions=lambda b: b[1])
    state = model.state_dict()
    assert set(ranks[0]["held"]) == set(ranks[1]["held"]) == {f"net.{i}.{h}.weight" for i in (2, 5)
                                                             for h in ("down", "up")}
    for k in ranks[0]["held"]:
        first, second = torch.tensor(ranks[0]["held"][k]), torch.tensor(ranks[1]["held"][k])
        assert torch.equal(first, second), f"{k}: the DDP replicas start from different weights"
        torch.testing.assert_close(first, state[k], rtol=0, atol=1e-6, msg=lambda m: f"{k}: {m}")
    for rank in ranks:
        assert rank["kept"] == pytest.approx(kept, rel=1e-9)
