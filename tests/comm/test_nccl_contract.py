"""The GPU path keeps NCCL's contract: the end-to-end paths, run on CPU processes under :mod:`nccl_contract`.

One launch of 4 processes runs, in the same processes one after the other (as several scripts would):

* 4 stages (the middle ones talk to two neighbours; a tied embedding and head make the first and the last stage sum
  their gradients): training with every variant (uncompressed under 16-mixed with clipping, direct with autotune, ef21,
  aqsgd, clapping-fc and clapping-fu under lazy sampling), a full and a sharded checkpoint each resumed, then
  validate, test and predict;
* 2 stages x 2 replicas: training with validation (``sync_dist``), clipping, and a full checkpoint.

All runs use ``prepost_receives=False``, the NCCL path (messages matched by their order). Every rank records its
``torch.distributed`` calls; the test process judges all ranks' records together (:func:`nccl_contract.judge`).
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import nccl_contract
from conftest import launch_forked

VOCAB, SEQ, N = 16, 4, 32


class TiedNet(L.LightningModule):
    """Tokens -> embedding -> an MLP -> a head that shares the embedding's weight (GPT-2's tie, in small)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.body = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh())
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.body(self.emb(x).mean(1)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


SPLITS = {4: ["body.0", "body.2", "head"], 2: ["body.2"]}


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, VOCAB, (N, SEQ), generator=g), torch.randint(0, VOCAB, (N,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1))


def _trainer(stages: int, steps: int, **strategy_kwargs) -> L.Trainer:
    from lightning_clapping import ClappingStrategy

    clip = strategy_kwargs.pop("clip", None)
    checkpointing = strategy_kwargs.pop("checkpointing", False)
    plugins = []
    if strategy_kwargs.pop("fp16", False):  # a loss scale shared by all stages (precision.SharedLossScale)
        from lightning.pytorch.plugins.precision import MixedPrecision

        plugins.append(MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu")))
    strategy = ClappingStrategy(split_points=SPLITS[stages], microbatches=2, prepost_receives=False,
                                liveness=None, **strategy_kwargs)
    return L.Trainer(accelerator="cpu", devices=4, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=checkpointing, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=1,
                     gradient_clip_val=clip, plugins=plugins)


def _fit(stages: int, steps: int, p: float | None = None, ckpt: Path | None = None, save: Path | None = None,
         **kw) -> L.Trainer:
    from lightning_clapping import LazySamplingDataModule

    torch.manual_seed(0)
    trainer = _trainer(stages, steps, **kw)
    data = _loader() if p is None else LazySamplingDataModule(_loader(), p=p, seed=3)
    trainer.fit(TiedNet(), data, ckpt_path=str(ckpt) if ckpt else None)
    if save is not None:
        trainer.save_checkpoint(save)
    return trainer


def _scenarios(out: Path) -> None:
    """What every rank runs (the module docstring)."""
    q = {"forward_codec": "q4", "backward_codec": "q8"}
    _fit(4, 2, variant="uncompressed", clip=1.0, fp16=True)
    _fit(4, 3, variant="direct", autotune=True, **q)
    _fit(4, 2, variant="ef21", **q)
    _fit(4, 2, p=1.0, variant="aqsgd", **q)
    _fit(4, 2, p=0.5, variant="clapping-fc", **q)
    trainer = _fit(4, 2, p=0.5, variant="clapping-fu", **q)
    model = trainer.lightning_module
    eval_trainer = _trainer(4, 1, variant="direct", compress_eval=True, **q)
    eval_trainer.validate(model, _loader())
    eval_trainer.test(model, _loader())
    eval_trainer.predict(model, _loader())
    # 2 stages x 2 replicas: checkpoints saved and resumed, in both layouts
    _fit(2, 2, p=0.5, variant="clapping-fc", clip=1.0, save=out / "fc.ckpt", checkpointing=True, **q)
    _fit(2, 3, p=0.5, variant="clapping-fc", clip=1.0, ckpt=out / "fc.ckpt", **q)
    _fit(2, 2, variant="ef21", state_dict_type="sharded", save=out / "sharded", **q)
    _fit(2, 3, variant="ef21", state_dict_type="sharded", ckpt=out / "sharded", **q)


def _rank_main(out: str) -> None:
    """One rank: record its calls while it runs the scenarios, then write them down."""
    contract = nccl_contract.Contract() if os.environ.get("NO_CONTRACT") else nccl_contract.Contract.install()
    try:
        _scenarios(Path(out))
    finally:
        contract.uninstall() if contract._patched else None
        contract.dump(Path(out) / f"rank{os.environ['LOCAL_RANK']}.json", int(os.environ["LOCAL_RANK"]))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("nccl_contract")
    launch_forked(_rank_main, str(out), ranks=4, cwd=out, timeout=240)
    return nccl_contract.load(out)


#: where the paths of the scenarios call torch.distributed: the run must have gone through each
PATHS = ("comm/p2p.py", "autotune/probe.py", "comm/step_results.py", "comm/replicas.py", "checkpoint/state.py",
         "precision.py", "step_driver.py", "pipeline/executor.py", "shuffle.py", "collectives.py")


def test_every_distributed_call_of_the_end_to_end_paths_keeps_nccls_contract(records):
    assert len(records) == 4
    called = {launch["where"].split(":")[0] for r in records for launch in r["launches"]}
    assert set(PATHS) <= called, f"the scenarios never reached {set(PATHS) - called}"
    problems = nccl_contract.judge(records)
    assert not problems, "\n".join(problems[:20])


def test_no_end_to_end_path_unpickles_what_a_peer_sent(records):
    # torch's object collectives unpickle the sender's bytes; the engine sends JSON and raw tensor bytes instead
    # (comm/safe_objects.py), also for Lightning's strategy.broadcast (ModelCheckpoint's folder in the 2 x 2 runs).
    # What remains is torch.distributed.checkpoint's own planning exchange in a sharded save or load (torch's
    # library, between the ranks of one job, at a checkpoint)
    objects = [launch for r in records for launch in r["launches"] if launch["op"].endswith(("_object", "_object_list"))]
    pickled = [(launch["op"], launch["where"]) for launch in objects if not launch["by_dcp"]]
    assert not pickled, pickled[:10]
    assert {launch["where"].split(" ")[1] for launch in objects} <= {"(save_sharded)", "(load_sharded_model)",
                                                                   "(load_sharded_optimizers)"}, objects[:3]
    called = {launch["where"].split(":")[0] for r in records for launch in r["launches"]}
    assert "comm/safe_objects.py" in called, called


# ------------------------------------------------------------------------------- the checker's own promises
def test_host_tensors_are_those_made_without_a_device_and_what_is_computed_from_them_alone():
    from nccl_contract import HostTensors, is_host

    device = torch.device("cpu")  # what the stage's device is on a CPU run
    with HostTensors():
        made = torch.zeros(3)
        placed = torch.zeros(3, device=device)
        derived, mixed, like = made * 2, made + placed, torch.zeros_like(made)
        moved, copied, named = made.to(device), placed.cpu(), torch.ones(2, device="cpu")
    assert is_host(made) and is_host(derived) and is_host(like) and is_host(copied) and is_host(named)
    assert not (is_host(placed) or is_host(mixed) or is_host(moved))
    assert is_host(made) and not is_host(placed)  # moving or copying left the originals where they were


def _records(*ranks):
    """Records of ranks 0..n-1 as Contract.dump writes them; each rank is a list of launches
    ``(kind, op, ops, sig)`` on group "g" of all ranks (lone ones on their pair's communicator)."""
    n = len(ranks)
    out = []
    for rank, launches in enumerate(ranks):
        rows = []
        for i, (kind, op, ops, sig) in enumerate(launches):
            comm, comm_ranks = "g", list(range(n))
            if kind == "lone":
                pair = sorted({rank, ops[0][1]})
                comm, comm_ranks = f"g/pair{pair[0]}-{pair[1]}", pair
            rows.append({"i": i, "kind": kind, "op": op, "group": "g", "ranks": list(range(n)), "comm": comm,
                         "comm_ranks": comm_ranks, "sig": sig, "ops": ops, "where": f"rank{rank}#{i}"})
        out.append({"rank": rank, "violations": [], "launches": rows})
    return out


def _msg(send, peer, numel=8, dtype="torch.uint8"):
    return [send, peer, numel, dtype, 0]


GATHER = ("coll", "all_gather", [], [[[4], "torch.float32"]])
OPEN = ("coll", "all_reduce", [], [[[1], "torch.float32"], "op=RedOpType.SUM"])


def test_batched_exchanges_in_the_same_order_on_every_rank_pass():
    batch = lambda peer: ("batch", "batch_isend_irecv", [_msg(False, peer), _msg(True, peer)], [])  # noqa: E731
    assert nccl_contract.judge(_records([OPEN, batch(1), GATHER], [OPEN, batch(0), GATHER])) == []


def test_collectives_in_another_order_on_one_rank_are_reported():
    problems = nccl_contract.judge(_records([OPEN, GATHER], [GATHER, OPEN]))
    assert any("collective #0" in p and "rank0#0" in p and "rank1#0" in p for p in problems), problems


def test_messages_matched_by_order_must_agree_in_size_and_in_how_they_were_issued():
    send = ("batch", "batch_isend_irecv", [_msg(True, 1, numel=8)], [])
    smaller = ("batch", "batch_isend_irecv", [_msg(False, 0, numel=4)], [])
    lone = ("lone", "irecv", [_msg(False, 0, numel=8)], [])
    for receive in (smaller, lone):
        problems = nccl_contract.judge(_records([OPEN, send], [OPEN, receive]))
        assert any("message #0 from rank 0 to rank 1" in p for p in problems), problems


def test_a_first_batched_call_that_not_every_rank_of_the_group_joins_is_reported():
    first, then = [_msg(True, 1)], ("coll", "barrier", [], [])
    ranks = ([("batch", "batch_isend_irecv", first, []), then], [("batch", "batch_isend_irecv", [_msg(False, 0)], []),
                                                                 then], [then])
    problems = nccl_contract.judge(_records(*ranks))
    assert any("first operation is a batch_isend_irecv" in p for p in problems), problems
    assert nccl_contract.judge(_records(*([OPEN, *r] for r in ranks))) == []  # after a collective: allowed


def test_an_order_that_only_gloo_runs_is_reported_as_a_deadlock_of_nccls_streams():
    # a point-to-point batch before a collective on one rank, after it on the other: one stream each, both stuck
    batch = lambda peer: ("batch", "batch_isend_irecv", [_msg(False, peer), _msg(True, peer)], [])  # noqa: E731
    problems = nccl_contract.simulate_streams(_records([OPEN, batch(1), GATHER], [OPEN, GATHER, batch(0)]))
    assert problems and "deadlock" in problems[0]


def _lone_receive_first(rank: int, port: int, out) -> None:
    """Both ranks post a lone receive, then the lone send the other waits for: fine on gloo."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    contract = nccl_contract.Contract.install()
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        got = torch.zeros(4, device=torch.device("cpu"))
        works = [dist.irecv(got, src=1 - rank), dist.isend(torch.ones(4, device=torch.device("cpu")), dst=1 - rank)]
        for w in works:
            w.wait()
        dist.all_reduce(torch.tensor([1.0]))  # made without a device: a CPU tensor on a GPU run
        out.put({"rank": rank, "violations": contract.violations, "launches": contract.launches})
    finally:
        contract.uninstall()
        dist.destroy_process_group()


def test_a_real_run_that_gloo_completes_is_judged_as_nccl_would_run_it():
    from conftest import run_gloo_ranks

    records, codes = run_gloo_ranks(_lone_receive_first, expected=2)
    assert codes == [0, 0]
    problems = nccl_contract.judge(sorted(records, key=lambda r: r["rank"]))
    assert any("host tensor (1,) torch.float32" in p and "all_reduce" in p for p in problems), problems
    assert any("deadlock" in p and "irecv" in p for p in problems), problems


class ThreeLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _three_stage_step(rank: int, port: int, out) -> None:
    """One training step of a 3-stage executor over a pipeline group of its own (as a mesh gives it), recorded."""
    import torch.distributed as dist

    from lightning_clapping.codecs.feedback import MessageRule
    from lightning_clapping.comm.placement import Placement, Topology
    from lightning_clapping.pipeline.executor import PipelineExecutor
    from lightning_clapping.pipeline.partition import build_partition
    from lightning_clapping.pipeline.stage import StageRunner

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)
    contract = nccl_contract.Contract.install()
    try:
        group = dist.new_group([0, 1, 2])
        torch.manual_seed(0)
        net = ThreeLayers()
        placement = Placement(Topology(3, 1, 3), rank, torch.device("cpu"), pp_group=group)
        runner = StageRunner(net, build_partition(net, 3, ["b", "c"]), stage=placement.stage)
        runner.release_foreign_state()
        runner.install()
        executor = PipelineExecutor(runner, placement, lambda b, d, t: MessageRule("uncompressed", "identity", b, d),
                                    prepost=False)
        micro = [torch.randn(2, 6, device=torch.device("cpu")) for _ in range(2)]
        executor.train_step(micro, lambda x, j: net(x).pow(2).mean(), [0.5, 0.5])
        out.put({"rank": rank, "violations": contract.violations, "launches": contract.launches})
    finally:
        contract.uninstall()
        dist.destroy_process_group()


def test_a_pipeline_of_three_stages_opens_its_group_with_every_stage_before_its_first_messages():
    from conftest import run_gloo_ranks

    records, codes = run_gloo_ranks(_three_stage_step, expected=3, world=3)
    assert codes == [0, 0, 0]
    records = sorted(records, key=lambda r: r["rank"])
    assert all(any(x["kind"] == "batch" for x in r["launches"]) for r in records)
    assert nccl_contract.judge(records) == []
