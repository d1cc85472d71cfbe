"""How the processes start and connect, and how a hung one is noticed.

Every process runs the user's script (``start_method="popen"``, as ``python train.py``, torchrun or SLURM do); spawn
and fork are refused. A model that cannot be trained as a pipeline is refused in the launching process, before any
other process starts. The processes connect with :func:`connect`, in a namespace of the key-value store that is new
for every start of the job (see there: torchrun's restarts), and then each starts the liveness watchdog
(:mod:`lightning_clapping.comm.liveness`).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_clapping import _compat
from lightning_clapping.comm import liveness
from lightning_clapping.comm.placement import Placement

SPAWN_REFUSED = (
    "ClappingStrategy launches one process per stage by re-running your script (start_method='popen', as "
    "`python train.py`, torchrun or SLURM do). {how} is refused: a spawned or forked run copies back only rank 0's "
    "weights when it ends, so a model cut into stages would silently come back with most of its weights untrained."
)


def refuse_spawn(start_method: str) -> None:
    """Only ``"popen"``: the reason is in :data:`SPAWN_REFUSED`."""
    if start_method != "popen":
        raise ValueError(SPAWN_REFUSED.format(how=f"start_method={start_method!r}"))


class ClappingLauncher(_compat.SubprocessScriptLauncher):
    """Lightning's script launcher, with the model checked before any process starts.

    ``check_model(model, partition)`` raises with what to change; ``partition=False`` when the model builds its
    layers in ``configure_model()`` (they do not exist yet: it is cut in ``setup()``, on every rank).
    """

    def __init__(self, check_model: Callable[[pl.LightningModule, bool], Any], *args: Any) -> None:
        super().__init__(*args)
        self._check_model = check_model

    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        model = next((a for a in args if isinstance(a, pl.LightningModule)), None)
        if model is None and trainer is not None:
            model = trainer.lightning_module
        if model is not None:
            self._check_model(model, not is_overridden("configure_model", model))
        return super().launch(function, *args, trainer=trainer, **kwargs)


#: where, in a store that outlives the processes, each start of the job gets its namespace (``ROUND_PREFIX/<token>``)
ROUND_PREFIX = "clapping/round"
_HANDSHAKE = "clapping/round-handshake"
_POLL = 0.01  # seconds between two looks at the store during the handshake


def store_outlives_processes() -> bool:
    """Whether the rendezvous store is served by a process that outlives this job's processes: torchrun's elastic
    agent, which says so in ``TORCHELASTIC_USE_AGENT_STORE`` (the variable torch's ``env://`` rendezvous reads)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def connect(cluster_environment: Any, backend: str, timeout: timedelta) -> None:
    """Create the default process group; under torchrun, in a namespace of the store of this start's own.

    Why: torchrun's elastic agent serves the store at the same address for the whole job and keeps it across
    ``--max-restarts`` (static rendezvous, and the c10d one with its shared store, torch's default since 2.5). torch's
    process groups find one another under fixed keys in it: gloo's full mesh reads each rank's listening address at
    ``default_pg/0//cpu//0/<rank>`` (NCCL its unique id likewise). So a restarted process can read the address that
    the killed round's process of that rank published, before the new one has replaced it; it connects to a socket
    that no longer exists and ``connectFullMesh failed ... Connection refused`` ends the restart. Whether that
    happens is a race between the new processes, which is why a restart healed some of the time. The liveness
    watchdog's counters and the failure reasons of :mod:`lightning_clapping.comm.failures` live in the same store
    and were carried over too. ``TORCHELASTIC_RESTART_COUNT`` cannot name the namespace: each node's agent counts
    its own restarts, and they differ when only some nodes' processes failed. The ranks agree on a fresh name with
    :func:`round_token` instead.
    """
    if dist.is_initialized():
        return
    rank, world_size = cluster_environment.global_rank(), cluster_environment.world_size()
    if world_size == 1 or not store_outlives_processes():
        _compat.init_dist_connection(cluster_environment, backend, timeout=timeout)
        return
    os.environ["MASTER_ADDR"] = cluster_environment.main_address
    os.environ["MASTER_PORT"] = str(cluster_environment.main_port)
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    store.set_timeout(timeout)
    token = round_token(store, rank, world_size, timeout)
    _compat.init_dist_connection(cluster_environment, backend, timeout=timeout,
                                 store=dist.PrefixStore(f"{ROUND_PREFIX}/{token}", store))


def round_token(store: Any, rank: int, world_size: int, timeout: timedelta) -> str:
    """A name that every rank of this start of the job agrees on, and no earlier start used, through a store that may
    hold any keys an earlier start left.

    Rank 0 draws a random token; every other rank draws a random nonce, asks for the token with it, and
    acknowledges the answer that carries its nonce. Rank 0 answers each rank's latest request until that rank
    acknowledges the answer with this token. A request, answer or acknowledgement left by a dead process carries a
    nonce or token nobody of this start drew, so it is answered in vain or ignored, never taken for this start's.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    if rank != 0:
        nonce = secrets.token_hex(8)
        store.set(f"{_HANDSHAKE}/ask/{rank}", nonce)
        while True:
            answer = _get(store, f"{_HANDSHAKE}/answer/{rank}")
            if answer is not None and answer.startswith(nonce + ":"):
                store.set(f"{_HANDSHAKE}/ack/{rank}", answer)
                return answer.partition(":")[2]
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank {rank} waited {timeout} for rank 0 to name this start of the job in the store at "
                    f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}; rank 0 never answered. "
                    "Check that rank 0's process started and reached its Trainer.")
            time.sleep(_POLL)
    token = secrets.token_hex(8)
    answered: dict[int, str] = {}
    waiting = set(range(1, world_size))
    while waiting:
        for peer in sorted(waiting):
            ask = _get(store, f"{_HANDSHAKE}/ask/{peer}")
            if ask is None:
                continue
            if answered.get(peer) != ask:
                store.set(f"{_HANDSHAKE}/answer/{peer}", f"{ask}:{token}")
                answered[peer] = ask
            if _get(store, f"{_HANDSHAKE}/ack/{peer}") == f"{ask}:{token}":
                waiting.discard(peer)
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(
                f"rank 0 waited {timeout} for ranks {sorted(waiting)} to join this start of the job; they never "
                "asked (or never acknowledged). Check that every process started and reached its Trainer.")
        if waiting:
            time.sleep(_POLL)
    return token


def _get(store: Any, key: str) -> str | None:
    """The value at ``key``, or None when absent (never waits for it)."""
    return store.get(key).decode() if store.check([key]) else None


def start_watchdog(placement: Placement, bound: timedelta) -> liveness.Watchdog:
    """This rank's heartbeat and the watch over the others' (``bound``: the silence after which one is hung)."""
    seconds = bound.total_seconds()
    # which rank serves the store (none under torchrun: its agent does) comes from the launcher's variables
    return liveness.Watchdog(
        _compat.default_store(), placement.global_rank, placement.num_ranks, stage_of_rank=placement.stage_of_rank,
        interval=min(1.0, seconds / 8), bound=seconds, store_rank=liveness.store_rank_from_env(),
    ).start()
