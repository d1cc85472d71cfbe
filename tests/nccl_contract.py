"""A checker of NCCL's contract, for runs on CPU processes over gloo.

gloo accepts what NCCL refuses or deadlocks on, so a run that passes on CPU can still fail on its first GPU step. This
module watches every ``torch.distributed`` call of a rank (:class:`Contract`, installed in each rank of a CPU run)
and then judges the records of all ranks together (:func:`judge`), against what NCCL demands:

**(a) Device.** NCCL carries CUDA tensors only. On a CPU run every tensor is a CPU tensor, so the checker tells the
two kinds apart by how a tensor was made (:class:`HostTensors`, a ``TorchFunctionMode``): a tensor made without a
device (``torch.tensor``, ``zeros``, ``empty``, ``arange``, ``frombuffer``, ``from_numpy``, ... with no ``device=``),
by ``.cpu()``, or with the device given as the string ``"cpu"`` is a *host* tensor; so is what an operation computes
from host tensors only (``zeros_like``, ``cat``, views, arithmetic). A tensor made with a ``torch.device`` object
(``device=placement.device``, ``.to(device)``) is not, and neither is anything made outside the mode (parameters,
gradients, what autograd makes). A host tensor handed to any collective or point-to-point call is a violation: on a
GPU it would be a CPU tensor under NCCL. What the checker cannot see: a ``torch.device("cpu")`` object written in the
code (it reads as the stage's device on a CPU run). Object collectives (``all_gather_object``, ...) move their
bytes to the current CUDA device themselves under NCCL and are not checked inside. NCCL's dtypes (no int16, no
unsigned wider than 8 bits), dense contiguous tensors, a known source for every receive, and no
``monitored_barrier`` (gloo only) are checked too.

**(b) Point-to-point rules.** A ``batch_isend_irecv`` runs on the group's own communicator (NCCL builds it in the
group's first operation, in which every rank of the group must take part: torch's documented rule for a first
batched call), a lone ``isend``/``irecv`` on a communicator of the two ranks. NCCL matches messages by their order
between two ranks, ignoring tags, so the k-th message sent from rank A to rank B in a group must be the k-th message
B receives from A there, with the same element count and dtype, issued the same way (both batched or both lone).
And NCCL runs a communicator's operations one after another on one stream: :func:`simulate_streams` replays every
rank's calls on such streams (a collective completes when every rank has reached it, a message when both ends
have) and reports an order that would deadlock there, e.g. two ranks that each post a lone receive before the send
the other waits for, or a point-to-point group issued before a collective on one rank and after it on another.
The replay lets every rank issue all it issued on gloo (what the CPU waits for is not modelled: gloo waits too).

**(c) Collective order.** Every rank of a group issues the same collectives in the same order, with the same shapes,
dtypes, reduce operations and roots.
"""

from __future__ import annotations

import functools
import inspect
import json
import sys
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

HOST = "_nccl_contract_host"  # the attribute a host tensor carries

#: dtypes NCCL reduces and moves (complex tensors travel as real views of these)
NCCL_DTYPES = {torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
               torch.float32, torch.float64, torch.complex64, torch.complex128,
               *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))}

_MOVES = {"to", "cpu", "cuda", "type_as"}


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj``, looking into lists, tuples and dict values (a cheap ``tree_leaves``)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors(x)]
    return []


def is_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, HOST, False)


def _tag(t: torch.Tensor, host: bool) -> None:
    if host:
        setattr(t, HOST, True)
    elif getattr(t, HOST, False):
        delattr(t, HOST)


def _device_arg(func: Any, args: tuple, kwargs: dict) -> tuple[bool, bool | None, Any]:
    """(whether the call names where its result lives, whether that is the host, a tensor whose place it takes)."""
    name = getattr(func, "__name__", "")
    if name == "cpu":
        return True, True, None
    if name == "cuda":
        return True, False, None
    device = kwargs.get("device")
    if name in _MOVES:
        for a in args[1:]:
            if isinstance(a, torch.Tensor):
                return True, None, a
            if isinstance(a, (str, torch.device)):
                device = a
    if device is None:
        return False, None, None
    return True, isinstance(device, str) and device.startswith("cpu"), None


class HostTensors(TorchFunctionMode):
    """Tags host tensors as the module docstring says (a Python attribute, :data:`HOST`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            return self._classify(func, args, kwargs, out)
        except Exception:  # never let the bookkeeping change what the run computes
            return out

    def _classify(self, func, args, kwargs, out):
        inputs = _tensors(args) + _tensors(kwargs)
        named, host, like = _device_arg(func, args, kwargs)
        if named:
            host = is_host(like) if like is not None else host
            if any(out is x for x in inputs) and is_host(out) != host:
                if isinstance(out, torch.nn.Parameter):
                    _tag(out, host)  # a module moved "in place": its parameter is where it was moved
                    return out
                out = out.view_as(out)  # on a GPU this is a new tensor: the input stays where it was
            for t in _tensors(out):
                _tag(t, bool(host))
            return out
        host = all(is_host(x) for x in inputs)  # a factory (no tensor inputs) makes host tensors
        if host:
            for t in _tensors(out):
                if not any(t is x for x in inputs):
                    _tag(t, True)
        return out


def _tagging(fn):
    @functools.wraps(fn)
    def made_on_host(*args, **kwargs):
        t = fn(*args, **kwargs)
        _tag(t, True)
        return t

    return made_on_host


# ------------------------------------------------------------------------------------------------ the recorder
_COLLECTIVES = {  # name -> (tensor arguments, root argument, also recorded) of the collectives that carry tensors
    "broadcast": (("tensor",), "src", ()),
    "all_reduce": (("tensor",), None, ("op",)),
    "all_reduce_coalesced": (("tensors",), None, ("op",)),
    "reduce": (("tensor",), "dst", ("op",)),
    "all_gather": (("tensor_list", "tensor"), None, ()),
    "all_gather_into_tensor": (("output_tensor", "input_tensor"), None, ()),
    "all_gather_coalesced": (("output_tensor_lists", "input_tensor_list"), None, ()),
    "gather": (("tensor",), "dst", ()),  # only the root holds gather_list: checked, not compared
    "scatter": (("tensor",), "src", ()),
    "reduce_scatter": (("output", "input_list"), None, ("op",)),
    "reduce_scatter_tensor": (("output", "input"), None, ("op",)),
    "all_to_all": (("output_tensor_list", "input_tensor_list"), None, ()),
    "all_to_all_single": (("output", "input"), None, ()),
    "barrier": ((), None, ()),
}
_ROOT_LISTS = {"gather": "gather_list", "scatter": "scatter_list"}
_OBJECTS = {"all_gather_object": None, "gather_object": "dst", "broadcast_object_list": "src",
            "scatter_object_list": "src"}
_P2P = {"isend": True, "irecv": False, "send": True, "recv": False}


def _where() -> str:
    """The innermost frame of the project (or else of the test script) that led to the call."""
    frame, outside = sys._getframe(2), None
    while frame is not None:
        name = frame.f_code.co_filename
        if "lightning_clapping" in name:
            return f"{name.rsplit('lightning_clapping', 1)[1].lstrip('/')}:{frame.f_lineno} ({frame.f_code.co_name})"
        if outside is None and not any(part in name for part in ("/torch/", "/lightning/", __file__)):
            outside = f"{Path(name).name}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return outside or "?"


def _called_from(part: str) -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if part in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class Contract:
    """One rank's records (see the module docstring); :meth:`install` it first thing in the rank's process."""

    def __init__(self) -> None:
        self.launches: list[dict] = []
        self.violations: list[str] = []
        self._local = threading.local()
        self._mode = HostTensors()
        self._patched: list[tuple[Any, str, Any]] = []

    # -------------------------------------------------------------- installing
    @classmethod
    def install(cls) -> Contract:
        contract = cls()
        contract._install()
        return contract

    def _install(self) -> None:
        def patch(owner: Any, name: str, value: Any) -> None:
            self._patched.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

        for name in ("frombuffer", "from_numpy"):
            patch(torch, name, _tagging(getattr(torch, name)))
        wrappers = {}
        for name in (*_COLLECTIVES, *_OBJECTS, *_P2P, "batch_isend_irecv", "monitored_barrier", "send_object_list",
                     "recv_object_list"):
            wrappers[name] = self._wrap(name, getattr(c10d, name))
        for name, wrapper in wrappers.items():  # P2POp checks its op against c10d's names: both must be ours
            patch(c10d, name, wrapper)
            patch(dist, name, wrapper)
        self._mode.__enter__()

    def uninstall(self) -> None:
        self._mode.__exit__(None, None, None)
        for owner, name, value in reversed(self._patched):
            setattr(owner, name, value)
        self._patched.clear()

    def dump(self, path: Path, rank: int) -> None:
        Path(path).write_text(json.dumps({"rank": rank, "violations": self.violations, "launches": self.launches}))

    # -------------------------------------------------------------- wrapping
    def _wrap(self, name: str, fn: Any) -> Any:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth:  # called by torch itself inside a call we record (batches, object collectives)
                return fn(*args, **kwargs)
            self._local.depth = 1
            try:
                try:
                    bound = signature.bind(*args, **kwargs)
                    bound.apply_defaults()
                    self._record(name, bound.arguments)
                except Exception as err:  # a bug here must show, not pass as a clean run
                    self.violations.append(f"checker failed on {name}: {err!r}")
                return fn(*args, **kwargs)
            finally:
                self._local.depth = 0

        return wrapper

    def _group(self, group: Any) -> tuple[str, list[int]]:
        group = group if group is not None else dist.group.WORLD
        return str(group.group_name), list(dist.get_process_group_ranks(group))

    def _check_tensor(self, t: Any, what: str, where: str) -> None:
        if not isinstance(t, torch.Tensor):
            return
        shape = tuple(t.shape)
        if is_host(t):
            self.violations.append(f"{what}: a host tensor {shape} {t.dtype} (NCCL carries CUDA tensors only) at "
                                   f"{where}")
        if t.dtype not in NCCL_DTYPES:
            self.violations.append(f"{what}: dtype {t.dtype} is not one NCCL carries, at {where}")
        if not t.is_contiguous() or t.is_sparse:
            self.violations.append(f"{what}: a non-contiguous or sparse tensor {shape}, at {where}")

    def _launch(self, kind: str, name: str, group: Any, where: str, sig: list | None = None,
                ops: list | None = None) -> None:
        gname, ranks = self._group(group)
        if kind == "lone":
            me, peer = dist.get_rank(), ops[0][1]
            comm = f"{gname}/pair{min(me, peer)}-{max(me, peer)}"
            comm_ranks = sorted({me, peer})
        else:
            comm, comm_ranks = gname, ranks
        self.launches.append({"i": len(self.launches), "kind": kind, "op": name, "group": gname, "ranks": ranks,
                              "comm": comm, "comm_ranks": comm_ranks, "sig": sig or [], "ops": ops or [],
                              "where": where})

    def _record(self, name: str, a: dict) -> None:
        where = _where()
        what = f"{name} on group {self._group(a.get('group'))[0]}"
        if name == "monitored_barrier":
            self.violations.append(f"monitored_barrier at {where}: gloo only, NCCL has none")
            self._launch("coll", name, a.get("group"), where)
        elif name in _COLLECTIVES:
            tensor_args, root, extra = _COLLECTIVES[name]
            sig: list = []
            for arg in tensor_args:
                for t in tree_leaves(a.get(arg)):
                    self._check_tensor(t, what, where)
                    if isinstance(t, torch.Tensor):
                        sig.append([list(t.shape), str(t.dtype)])
            for t in tree_leaves(a.get(_ROOT_LISTS.get(name))):
                self._check_tensor(t, what, where)
            if root is not None:
                sig.append(f"{root}={_global_root(a, root)}")
            sig += [f"{e}={a.get(e)}" for e in extra]
            self._launch("coll", name, a.get("group"), where, sig)
        elif name in _OBJECTS:
            root = _OBJECTS[name]
            self._launch("coll", name, a.get("group"), where, [f"{root}={_global_root(a, root)}"] if root else [])
            # who asked for it: torch.distributed.checkpoint's planner exchanges its plans this way
            self.launches[-1]["by_dcp"] = _called_from("/torch/distributed/checkpoint/")
        elif name in ("send_object_list", "recv_object_list"):
            self.violations.append(f"{name} at {where}: unpickles what a peer sends (and is not order-checked)")
        elif name in _P2P:
            peer = _global_peer(a, "dst" if _P2P[name] else "src")
            if peer is None:
                self.violations.append(f"{what}: a receive from any source at {where}; NCCL needs the source")
                return
            self._check_tensor(a["tensor"], what, where)
            t = a["tensor"]
            self._launch("lone", name, a.get("group"), where,
                         ops=[[_P2P[name], peer, t.numel(), str(t.dtype), a.get("tag", 0)]])
        elif name == "batch_isend_irecv":
            ops_in = a["p2p_op_list"]
            if not ops_in:
                return
            groups = {self._group(op.group)[0] for op in ops_in}
            if len(groups) > 1:
                self.violations.append(f"batch_isend_irecv at {where}: operations on several groups {groups}")
            ops = []
            for op in ops_in:
                send = op.op is c10d.isend
                self._check_tensor(op.tensor, f"batch_isend_irecv on group {next(iter(groups))}", where)
                ops.append([send, int(op.peer), op.tensor.numel(), str(op.tensor.dtype), op.tag])
            self._launch("batch", "batch_isend_irecv", ops_in[0].group, where, ops=ops)


def _global_root(a: dict, root: str) -> Any:
    group = a.get("group")
    if a.get(root) is not None or group is None:
        return a.get(root)
    local = a.get(f"group_{root}")
    return dist.get_global_rank(group, local) if local is not None else None


def _global_peer(a: dict, key: str) -> int | None:
    peer = _global_root(a, key)
    return None if peer is None else int(peer)


# ----------------------------------------------------------------------------------------------- the judgement
def load(folder: Path) -> list[dict]:
    """Every rank's records written by :meth:`Contract.dump` into ``folder`` (``rank*.json``), by rank."""
    records = [json.loads(p.read_text()) for p in Path(folder).glob("rank*.json")]
    return sorted(records, key=lambda r: r["rank"])


def judge(records: list[dict]) -> list[str]:
    """Every breach of the contract in the ranks' records (empty: the run would run the same under NCCL)."""
    problems = [f"rank {r['rank']}: {v}" for r in records for v in dict.fromkeys(r["violations"])]
    problems += check_collective_order(records)
    problems += check_first_operations(records)
    problems += check_message_order(records)
    problems += simulate_streams(records)
    return problems


def _by_group(records: list[dict], kinds: tuple[str, ...]) -> dict[tuple[str, tuple], dict[int, list[dict]]]:
    out: dict[tuple[str, tuple], dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for launch in r["launches"]:
            if launch["kind"] in kinds:
                out[(launch["group"], tuple(launch["ranks"]))][r["rank"]].append(launch)
    return out


def check_collective_order(records: list[dict]) -> list[str]:
    """(c): per group, every rank's collectives agree, one by one."""
    problems = []
    for (group, ranks), per_rank in _by_group(records, ("coll",)).items():
        seqs = {r: [(x["op"], json.dumps(x["sig"])) for x in per_rank.get(r, [])] for r in ranks}
        first = ranks[0]
        for r in ranks[1:]:
            a, b = seqs[first], seqs[r]
            for i in range(max(len(a), len(b))):
                if i >= len(a) or i >= len(b) or a[i] != b[i]:
                    def show(rank, seq):
                        if i >= len(seq):
                            return f"rank {rank}: nothing (it issued {len(seq)})"
                        return f"rank {rank}: {seq[i][0]} {seq[i][1]} at {per_rank[rank][i]['where']}"

                    problems.append(f"group {group} {list(ranks)}, collective #{i}: {show(first, a)}; {show(r, b)}")
                    break
    return problems


def check_first_operations(records: list[dict]) -> list[str]:
    """(b): a group whose first operation is a batch_isend_irecv needs every one of its ranks in that one call: every
    rank's first operation on the group is a batch, and each message of it pairs with one of the peer's first batch
    (three stages whose first batches are 0-1 and 1-2 are two calls, not one)."""
    problems = []
    for (group, ranks), per_rank in _by_group(records, ("coll", "batch")).items():
        firsts = {r: per_rank[r][0] for r in ranks if per_rank.get(r)}
        if not any(f["kind"] == "batch" for f in firsts.values()):
            continue
        joint = len(firsts) == len(ranks) and all(f["kind"] == "batch" for f in firsts.values()) and all(
            any(o[0] != send and o[1] == r for o in firsts[peer]["ops"])
            for r, f in firsts.items() for send, peer, *_ in f["ops"])
        if not joint:
            shown = {r: (f["op"], f["where"]) for r, f in firsts.items()}
            problems.append(
                f"group {group} {list(ranks)}: its first operation is a batch_isend_irecv that not every rank of the "
                f"group takes part in (their first operations: {shown}); NCCL builds the group's communicator in its "
                "first call, with every rank: open the group with a collective first")
    return problems


def _messages(records: list[dict]) -> dict[tuple[str, int, int, bool], list[tuple]]:
    """(group, src, dst, sent?) -> [(kind, numel, dtype, where), ...] in issue order."""
    out: dict[tuple[str, int, int, bool], list[tuple]] = defaultdict(list)
    for r in records:
        me = r["rank"]
        for launch in r["launches"]:
            for send, peer, numel, dtype, _tag_ in launch["ops"]:
                src, dst = (me, peer) if send else (peer, me)
                out[(launch["group"], src, dst, send)].append((launch["kind"], numel, dtype, launch["where"]))
    return out


def check_message_order(records: list[dict]) -> list[str]:
    """(b): between two ranks of a group, the k-th message sent is the k-th received, alike (tags do not count)."""
    problems = []
    msgs = _messages(records)
    for (group, src, dst, send), sent in list(msgs.items()):
        if not send:
            continue
        got = msgs.get((group, src, dst, False), [])
        for k in range(max(len(sent), len(got))):
            a = sent[k] if k < len(sent) else None
            b = got[k] if k < len(got) else None
            if a is None or b is None or a[:3] != b[:3]:
                problems.append(f"group {group}: message #{k} from rank {src} to rank {dst}: sent {a}, received {b} "
                                "(NCCL matches by order: kind, size and dtype must agree)")
                break
    for (group, src, dst, send), got in msgs.items():
        if not send and (group, src, dst, True) not in msgs:
            problems.append(f"group {group}: rank {dst} receives {len(got)} messages from rank {src}, which sends "
                            f"none (first: {got[0]})")
    return problems


def simulate_streams(records: list[dict]) -> list[str]:
    """(b): replay every rank's launches on NCCL's streams, one per communicator; report a deadlock."""
    queues: dict[tuple[str, int], list[dict]] = defaultdict(list)  # (comm, rank) -> launches in issue order
    comm_ranks: dict[str, list[int]] = {}
    for r in records:
        counts: dict[tuple[str, int, int], int] = defaultdict(int)  # (comm, src, dst) -> messages so far
        for launch in r["launches"]:
            pending = set()
            for send, peer, *_ in launch["ops"]:
                src, dst = (r["rank"], peer) if send else (peer, r["rank"])
                key = (launch["comm"], src, dst)
                pending.add((send, src, dst, counts[key]))
                counts[key] += 1
            queues[(launch["comm"], r["rank"])].append({**launch, "pending": pending})
            comm_ranks[launch["comm"]] = launch["comm_ranks"]
    heads = dict.fromkeys(queues, 0)

    def head(comm: str, rank: int) -> dict | None:
        q = queues.get((comm, rank), [])
        i = heads.get((comm, rank), 0)
        return q[i] if i < len(q) else None

    progress = True
    while progress:
        progress = False
        for comm, ranks in comm_ranks.items():
            now = {r: head(comm, r) for r in ranks}
            if all(x is not None and x["kind"] == "coll" for x in now.values()):
                for r in ranks:
                    heads[(comm, r)] += 1
                progress = True
                continue
            for r, x in now.items():
                if x is None or x["kind"] == "coll":
                    continue
                for op in list(x["pending"]):
                    send, src, dst, k = op
                    peer = dst if send else src
                    y = now.get(peer)
                    twin = (not send, src, dst, k)
                    if y is not None and y["kind"] != "coll" and twin in y["pending"]:
                        x["pending"].discard(op)
                        y["pending"].discard(twin)
                        progress = True
            for r, x in now.items():
                if x is not None and x["kind"] != "coll" and not x["pending"]:
                    heads[(comm, r)] += 1
                    progress = True
    stuck = [(key, q[heads[key]]) for key, q in queues.items() if heads[key] < len(q)]
    if not stuck:
        return []
    shown = "; ".join(f"rank {rank} on {comm}: {x['op']} #{x['i']} at {x['where']}"
                      for (comm, rank), x in sorted(stuck, key=lambda s: s[1]["i"])[:6])
    return [f"NCCL's streams would deadlock (every rank's next launch waits on another's): {shown}"]


__all__ = ["Contract", "HostTensors", "is_host", "judge", "load", "simulate_streams"]
