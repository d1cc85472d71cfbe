"""Objects between ranks without pickle (``comm/safe_objects.py``): what the engine's collectives after set-up and
``strategy.broadcast`` send is JSON plus raw tensor bytes, and whatever a peer sends is read without running code."""

from __future__ import annotations

import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import launch_forked
from lightning_clapping.comm import safe_objects
from lightning_clapping.comm.wire import WireError
from lightning_clapping.ft import wire  # frames this module's layout for a rejoining replica


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


TREE = {
    "lr": 0.01, "betas": (0.9, 0.999), "step": 7, "amsgrad": False, "name": "adam", "none": None,
    3: [float("inf"), float("-inf"), float("nan"), -0.0],
    (1, "a"): "tuple key",
    "dtype": torch.bfloat16, "shape": torch.Size([2, 3]), "dir": Path("/tmp/ckpts"),
    "tensors": [torch.arange(6, dtype=torch.float32).view(2, 3), torch.tensor(True), torch.zeros(0, 4),
                torch.tensor([-1, 2**40], dtype=torch.int64), torch.randn(3).to(torch.float16)],
}


def test_a_tree_of_plain_data_paths_and_tensors_comes_back_as_it_was_sent():
    blob, tensors = safe_objects.encode(TREE)
    back = safe_objects.decode(blob, safe_objects.tensor_bytes(tensors, torch.device("cpu")))
    assert _same(TREE, back), back


@pytest.mark.parametrize("obj", [object(), {1, 2}, b"bytes", [lambda: 0], {"x": Exception("e")},
                                 torch.nn.Linear(1, 1)])
def test_an_object_that_is_not_plain_data_is_refused_with_its_type(obj):
    with pytest.raises(TypeError, match="is not sent between ranks"):
        safe_objects.encode(obj)


class _Boom:
    def __reduce__(self):
        return (Path("ran").touch, ())


def test_a_pickled_payload_is_a_wire_error_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    crafted = pickle.dumps([_Boom()])
    with pytest.raises(WireError):
        safe_objects.decode(crafted)
    assert not (tmp_path / "ran").exists()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(blob=st.binary(max_size=200), data=st.binary(max_size=64))
def test_arbitrary_bytes_decode_or_raise_wire_error_only(blob, data):
    try:
        safe_objects.decode(blob, data)
    except WireError:
        pass


_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.floats(allow_nan=True) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(body=_JSONISH, data=st.binary(max_size=64))
def test_any_json_outline_decodes_or_raises_wire_error_only(body, data):
    import json

    try:
        safe_objects.decode(json.dumps(body).encode(), data)
    except WireError:
        pass


def test_tensor_bytes_that_do_not_match_the_outline_are_a_wire_error():
    blob, tensors = safe_objects.encode([torch.zeros(4)])
    with pytest.raises(WireError, match="need more"):
        safe_objects.decode(blob, bytes(15))
    with pytest.raises(WireError, match="take 16 bytes, 17 came"):
        safe_objects.decode(blob, bytes(17))


# ------------------------------------------------------------------------------------------- between processes
def _rank_main(out: str) -> None:
    import torch.distributed as dist

    rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    got = safe_objects.broadcast(TREE if rank == 1 else None, src=1)
    gathered = safe_objects.all_gather({"rank": rank, "names": [f"r{rank}"]})
    try:
        safe_objects.broadcast(object() if rank == 0 else None, src=0)
        refused = ""
    except TypeError as err:
        refused = str(err)
    try:  # one rank's part of a gather cannot be sent: every rank hears it
        safe_objects.all_gather([object()] if rank == 1 else [1])
        gather_refused = ""
    except TypeError as err:
        gather_refused = str(err)
    torch.save({"same": _same(TREE, got), "gathered": gathered, "refused": refused, "gather_refused": gather_refused},
               Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_broadcast_and_all_gather_between_processes_and_a_refusal_reaches_every_rank(tmp_path):
    launch_forked(_rank_main, str(tmp_path), ranks=2, cwd=tmp_path, timeout=60)
    for rank in (0, 1):
        seen = torch.load(tmp_path / f"rank{rank}.pt")
        assert seen["same"], f"rank {rank} got another tree"
        assert seen["gathered"] == [{"rank": 0, "names": ["r0"]}, {"rank": 1, "names": ["r1"]}]
        assert "is not sent between ranks" in seen["refused"], seen  # raised on the receiver too: nobody hangs
        assert "is not sent between ranks" in seen["gather_refused"], seen


_STATE = {"module": {"w": torch.randn(3, 4)}, "epoch": 2,
          "optimizer": {"state": {0: {"step": torch.tensor(3.0)}},
                        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}]}}
_REJOIN = wire.encode(_STATE)


@settings(max_examples=300, deadline=None)
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4),
       cut=st.none() | st.integers(0, 10_000))
def test_a_damaged_rejoin_state_decodes_or_raises_wire_error_only(flips, cut):
    # the state a rejoining replica takes from a peer (ft/wire.py)
    data = bytearray(_REJOIN)
    for pos, mask in flips:
        data[pos % len(data)] ^= mask
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    try:
        wire.decode(bytes(data))
    except WireError:
        pass
