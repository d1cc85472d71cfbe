"""Data parallel x pipeline: P stages x D replicas train like one process on the union of the replicas' batches."""

from __future__ import annotations

import json
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_clapping import ClappingStrategy, LazySamplingDataModule
from lightning_clapping.comm.placement import Topology
from lightning_clapping.comm.replicas import GradientAverager, _buckets
from lightning_clapping.stage_setup import Patches, shard_lazy_data
from conftest import launch_forked, run_gloo_ranks

DP_CONFIGS = "plain,clip_acc,fc_full,fc_first,fc_rest,sh_first,sh_rest"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("replicas")
    launch_forked("replicas_run.py", "dp", str(out), DP_CONFIGS, ranks=4, cwd=out, timeout=600)
    launch_forked("replicas_run.py", "single", str(out), "plain,clip_acc", ranks=1, cwd=out, timeout=300)

    def result(name: str, mode: str, rank: int = 0) -> dict:
        return json.loads((out / f"{name}_{mode}_rank{rank}.json").read_text())

    def weights(name: str, mode: str) -> dict[str, torch.Tensor]:
        return torch.load(out / f"weights_{name}_{mode}.pt")

    return SimpleNamespace(out=out, result=result, weights=weights)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", ["plain", "clip_acc"])
def test_two_replicas_of_two_stages_train_like_one_process_on_the_union_of_their_batches(runs, name):
    # "clip_acc": gradient clipping by the whole model's norm and accumulation over 2 batches, both after averaging
    assert _max_diff(runs.weights(name, "dp"), runs.weights(name, "single")) <= 1e-5


@pytest.mark.parametrize("name", ["plain", "fc_full"])  # Lightning's sampler; the lazy loader's own sharding
def test_replicas_train_on_different_data_and_the_stages_of_a_replica_on_the_same(runs, name):
    seen = [runs.result(name, "dp", r)["seen"] for r in range(4)]
    # ranks 0, 1: replica 0 (stages 1, 0); ranks 2, 3: replica 1
    assert seen[0] == seen[1] and seen[2] == seen[3]
    mine = {round(v, 6) for mb in seen[0] for v in mb}
    theirs = {round(v, 6) for mb in seen[2] for v in mb}
    assert not mine & theirs, "the replicas trained on overlapping samples"
    assert runs.result("plain", "dp")["world_size"] == 2  # trainer.world_size counts replicas, as under DDP


@pytest.mark.parametrize("name", ["plain", "clip_acc"])  # 3 optimizer steps each (clip_acc: of 2 batches)
def test_what_each_rank_sends_in_the_replicas_average_is_counted_in_the_byte_totals(runs, name):
    from _models import SequentialMLP

    # every trainable parameter's fp32 gradient and its presence flag, once per optimizer step; a ring all-reduce
    # over 2 replicas sends 2 (R - 1) / R = 1 times that from each rank
    per_step = sum((p.numel() + 1) * 4 for p in SequentialMLP().parameters())
    totals = runs.result(name, "dp")["totals"]
    assert totals["replica_bytes"] == 3 * per_step
    assert totals["bytes"] > totals["replica_bytes"] > 0  # the pipeline's messages and the average, both counted


def test_sync_dist_values_are_averaged_over_the_replicas(runs):
    dp = runs.result("plain", "dp")["losses"]
    assert dp == pytest.approx(runs.result("plain", "single")["losses"], abs=1e-6)
    assert all(runs.result("plain", "dp", r)["losses"] == dp for r in range(4))


def test_compressed_replicas_resume_exactly_with_each_replicas_feedback_buffers(runs):
    assert _max_diff(runs.weights("fc_full", "dp"), runs.weights("fc_rest", "dp")) == 0.0
    saved = torch.load(runs.out / "ckpt_fc_first" / "last.ckpt", weights_only=False)["clapping_feedback"]
    assert sorted(saved) == ["replica1_stage0", "replica1_stage1", "stage0", "stage1"]
    a, b = saved["stage0"]["fwd_out"], saved["replica1_stage0"]["fwd_out"]
    assert not all(torch.equal(x, y) for x, y in zip(_tensors(a), _tensors(b))), "replicas share one buffer"


def test_a_sharded_checkpoint_of_replicas_resumes_exactly(runs):
    # the consolidated sharded checkpoint holds replica 0's weights; every replica's buffers were saved and read
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(runs.out / "ckpt_sh_rest" / "last.ckpt", runs.out / "sh_rest.pt")
    rest = torch.load(runs.out / "sh_rest.pt", weights_only=False)
    assert _max_diff(rest["model"], runs.weights("fc_full", "dp")) == 0.0
    assert sorted(rest["clapping_feedback"]) == ["replica1_stage0", "replica1_stage1", "stage0", "stage1"]


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


# ------------------------------------------------------------------------------------------------ bad input
def _trainer(devices, num_nodes=1, **strategy_kwargs):
    return L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes,
                     strategy=ClappingStrategy(**strategy_kwargs), logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def test_processes_that_are_not_a_whole_number_of_replicas_are_refused():
    with pytest.raises(ValueError, match=r"stages=2, but the Trainer starts 3 processes.*among \[1, 3\]"):
        _trainer(3, stages=2)


def test_stages_that_disagree_with_split_points_are_refused():
    with pytest.raises(ValueError, match=r"stages=3 disagrees with split_points=\['net.4'\].*2 stages"):
        ClappingStrategy(split_points=["net.4"], stages=3)


def test_replicas_that_would_straddle_nodes_unevenly_are_refused():
    with pytest.raises(ValueError, match=r"2 stages x 3 replicas on nodes of 3 processes.*straddle"):
        _trainer(3, num_nodes=2, stages=2)


def test_nccl_without_cuda_is_refused():
    with pytest.raises(ValueError, match=r"process_group_backend='nccl' needs CUDA devices.*\['cpu'\]"):
        _trainer(2, process_group_backend="nccl")


def test_a_lazy_data_module_sharded_otherwise_than_the_strategy_is_refused():
    strategy = ClappingStrategy(stages=2)
    strategy.parallel_devices = [torch.device("cpu")] * 4
    dm = LazySamplingDataModule([[0]], p=0.5, num_replicas=3, replica_rank=0)
    with pytest.raises(ValueError, match=r"num_replicas=3\) but ClappingStrategy runs 2 data-parallel replicas"):
        shard_lazy_data(dm, strategy.num_replicas, strategy.replica, Patches())
    dm = LazySamplingDataModule([[0]], p=0.5)
    shard_lazy_data(dm, strategy.num_replicas, strategy.replica, Patches())
    assert (dm.num_replicas, dm.replica_rank) == (2, 0)


# ------------------------------------------------------------------------------------------------ the pieces
def test_topology_places_each_replica_on_consecutive_ranks_with_its_last_stage_first():
    topo = Topology(stages=2, replicas=2, ranks_per_node=2)
    assert topo.layout() == [[1, 0], [3, 2]]
    assert [topo.stage_of(r) for r in range(4)] == [1, 0, 1, 0]
    assert [topo.replica_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert topo.crossings() == []  # each replica on its own node: only the replicas' all-reduce crosses nodes
    across = Topology(stages=4, replicas=1, ranks_per_node=2)
    assert across.crossings() == [1]
    assert "boundaries crossing nodes: 1" in across.describe()


def test_gradients_fall_into_buckets_by_size_and_dtype():
    grads = [torch.zeros(10), torch.zeros(10), torch.zeros(10, dtype=torch.float64), torch.zeros(30)]
    sizes = [[g.numel() for g in b] for b in _buckets(grads, limit=80)]
    assert sizes == [[10, 10], [10], [30]]


def _average_worker(rank, port, out):
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in
              ((5, torch.float32), (7, torch.float32), (3, torch.float64))]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(rank * 10 + i))
    averager = GradientAverager(None, replicas=2, bucket_bytes=32)  # several buckets
    averager.start(params)
    averager.finish()
    out.put((rank, [p.grad.tolist() for p in params], averager.sent_bytes))
    dist.destroy_process_group()


def test_gradient_averager_averages_every_bucket_over_the_replicas():
    items, codes = run_gloo_ranks(_average_worker, expected=2)
    assert codes == [0, 0]
    for _, grads, sent in items:
        assert grads == [[5.0] * 5, [6.0] * 7, [7.0] * 3]
        # buckets of 5 and 7 fp32 values, then 3 fp64 ones with the 3 presence flags; a ring all-reduce over 2
        # replicas sends 2 (R - 1) / R = 1 times each bucket from every rank
        assert sent == 5 * 4 + 7 * 4 + (3 + 3) * 8


def _hook_worker(rank, port, out):
    import os

    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sent = []

    def hook(state, bucket):  # DDP's fp16 hook, recording what it was handed
        sent.append((bucket.index(), bucket.is_last(), [tuple(g.shape) for g in bucket.gradients()]))
        return fp16_compress_hook(state, bucket)

    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.full((2, 3), 1.0 + rank * (1 + 2 ** -12))  # the fp16 average rounds this
    params[1].grad = torch.full((4,), float(rank))
    averager = GradientAverager(None, replicas=2, bucket_bytes=24, comm_hook=hook)
    averager.start(params)
    averager.finish()
    out.put((rank, sent, params[0].grad[0, 0].item(), params[1].grad.tolist(), averager.sent_bytes))
    dist.destroy_process_group()


def test_a_ddp_communication_hook_averages_the_replicas_buckets():
    items, codes = run_gloo_ranks(_hook_worker, expected=2)
    assert codes == [0, 0]
    for _, sent, first, second, counted in items:
        assert counted == 0  # what a hook sends is the hook's to say: not counted as a plain all-reduce
        # the last bucket ends with the presence flags, one per parameter
        assert sent == [(0, False, [(2, 3)]), (1, True, [(4,), (2,)])]
        exact = 1.0 + (1 + 2 ** -12) / 2
        assert first != exact and first == pytest.approx(exact, abs=1e-3)  # went through fp16
        assert second == [0.5] * 4


# ------------------------------------------------------------------------------------------------ unused parameters
def _unused_worker(rank, port, out, hook_name):
    """Rank 0 has gradients for a, b and c; rank 1 for a and c only; neither for d. Three steps (PowerSGD compresses
    from its third)."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    hook, state = None, None
    if hook_name == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook as hook
    elif hook_name == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        hook = powersgd.powerSGD_hook
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    a, b, c, d = (torch.nn.Parameter(torch.zeros(shape)) for shape in ((3,), (4, 4), (5,), (2,)))
    averager = GradientAverager(None, replicas=2, bucket_bytes=16, comm_hook=hook, comm_state=state)  # several buckets
    for _ in range(3):
        for p in (a, b, c, d):
            p.grad = None
        a.grad = torch.full_like(a, 1.0 + rank)
        if rank == 0:
            b.grad = torch.full_like(b, 4.0)
        c.grad = torch.full_like(c, 2.0 * rank)
        averager.start([a, b, c, d])
        averager.finish()
    out.put((rank, [None if p.grad is None else p.grad.reshape(-1).tolist() for p in (a, b, c, d)]))
    dist.destroy_process_group()


@pytest.mark.parametrize("hook_name", [None, "fp16", "powersgd"])
def test_replicas_that_differ_in_which_parameters_have_gradients_average_each_parameter_as_ddp(hook_name):
    # DDP with find_unused_parameters: a missing gradient counts as zeros (the sum over the replicas divided by
    # their number), and a parameter no replica has a gradient for keeps none
    from functools import partial

    items, codes = run_gloo_ranks(partial(_unused_worker, hook_name=hook_name), expected=2)
    assert codes == [0, 0]
    for _, (a, b, c, d) in items:
        assert a == [1.5] * 3
        assert b == pytest.approx([2.0] * 16, rel=1e-5)  # a rank-1 matrix: PowerSGD's rank-1 approximation holds it
        assert c == [1.0] * 5
        assert d is None
    assert items[0][1] == items[1][1]


@pytest.fixture(scope="module")
def branch_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("branches")
    launch_forked("branch_replicas_run.py", "dp", str(out), "plain,ddp_fp16", ranks=4, cwd=out, timeout=300)
    launch_forked("branch_replicas_run.py", "single", str(out), ranks=1, cwd=out, timeout=120)
    return lambda mode, hook, rank: torch.load(out / f"branch_{mode}_{hook}_rank{rank}.pt")


@pytest.mark.parametrize("hook", ["plain", "ddp_fp16"])
def test_replicas_whose_branches_differ_end_with_equal_weights(branch_runs, hook):
    # ranks 0, 2: stage 1 of replicas 0 and 1; ranks 1, 3: stage 0. Replica 1 never took a branch, yet its
    # branches trained as replica 0's did
    for mine, theirs in ((0, 2), (1, 3)):
        a, b = branch_runs("dp", hook, mine), branch_runs("dp", hook, theirs)
        assert a["end"].keys() == b["end"].keys()
        assert all(torch.equal(a["end"][k], b["end"][k]) for k in a["end"]), f"ranks {mine} and {theirs} differ"
    for rank, branch in ((0, "branch1.weight"), (1, "branch0.weight")):
        run = branch_runs("dp", hook, rank)
        assert not torch.equal(run["start"][branch], run["end"][branch]), f"{branch} never trained"


def test_replicas_whose_branches_differ_train_like_one_process_on_the_union_of_their_batches(branch_runs):
    single = branch_runs("single", "plain", 0)["end"]
    dp = {**branch_runs("dp", "plain", 0)["end"], **branch_runs("dp", "plain", 1)["end"]}
    assert _max_diff(dp, single) <= 1e-5


def test_all_gather_in_an_epoch_end_hook_gathers_over_the_replicas(branch_runs):
    # the hook runs on the last stage of every replica (global ranks 0 and 2), so their gather is complete
    assert branch_runs("dp", "plain", 0)["gathered"] == [0.0, 2.0]
    assert branch_runs("dp", "plain", 2)["gathered"] == [0.0, 2.0]
