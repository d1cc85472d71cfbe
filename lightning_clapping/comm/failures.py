"""When a stage fails or goes astray: name the cause where the user looks (rank 0's error).

* A stage whose step raises leaves its reason in the process group's key-value store before its process ends. Rank
  0, which then fails only because its peer went away ("connection closed by peer"), raises :class:`StageFailure`
  with that stage's reason instead.
* Every stage reads the batch itself. On fresh steps each compares an order-sensitive fingerprint of its batch with
  the last stage's (sent with the step's results), so stages fed different data stop with the reason instead of
  training the inputs of one batch against the labels of another.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_clapping._compat import default_store, tree_flatten

_LOST = ("Connection closed", "Connection reset", "Broken pipe")


class StageFailure(RuntimeError):
    """Another stage failed; the message names it and its exception."""


def failure_key(rank: int) -> str:
    """Where a rank's failure reason lies in the store (also written by the liveness watchdog for a hung rank)."""
    return f"clapping/failure/{rank}"


@contextlib.contextmanager
def reported(stage: int, rank: int, num_stages: int) -> Generator[None, None, None]:
    """Run a step; on failure leave this stage's reason for rank 0, and on rank 0 raise the peer's reason."""
    try:
        yield
    except Exception as err:
        store = default_store() if num_stages > 1 else None
        if store is None:
            raise
        with contextlib.suppress(Exception):
            store.set(failure_key(rank), f"stage {stage} (rank {rank}) failed: {type(err).__name__}: {err}")
        if rank != 0 or not _is_peer_loss(err):
            raise
        cause = _peer_failure(store, num_stages)
        if cause is None:
            raise
        raise StageFailure(f"{cause}\n(rank 0 then lost its connection: {type(err).__name__}: {err})") from err


def _is_peer_loss(err: BaseException) -> bool:
    return isinstance(err, dist.DistBackendError) or any(s in str(err) for s in (*_LOST, "Timed out"))


def _peer_failure(store: Any, num_ranks: int, wait: float = 3.0) -> str | None:
    """The first reason another rank left that is not itself a lost connection (waits briefly for one)."""
    deadline = time.monotonic() + wait
    while True:
        found = None
        for rank in range(1, num_ranks):
            key = failure_key(rank)
            with contextlib.suppress(Exception):
                if store.check([key]):
                    text = store.get(key).decode()
                    if not any(s in text for s in _LOST):
                        return text
                    found = found or text
        if time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def fingerprint(batch: Any) -> tuple[int, ...]:
    """An order-sensitive digest of a batch: per tensor, a hash of its dtype, shape and bytes in order.

    Hashing the bytes makes it exact and independent of how a reduction is split over threads (a float sum of many
    values differed with the thread count, so identical data was refused)."""
    out = []
    for t in tree_flatten(batch)[0]:
        if isinstance(t, Tensor):
            digest = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=8)
            digest.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
            out.append(int.from_bytes(digest.digest(), "little"))
    return tuple(out)


def check_same_batch(mine: tuple[int, ...], last: tuple[int, ...], stage: int, step: int) -> None:
    if tuple(mine) != tuple(last):
        raise RuntimeError(
            f"stage {stage} trained on another batch than the last stage at step {step} (batch fingerprints {mine} "
            f"vs {last}): every stage must read the same batches in the same order. A DataLoader that shuffles with "
            "torch's global RNG, a sampler or dataset with per-process randomness, or data that differs between "
            "processes causes this: give the DataLoader a seeded `generator=` and make the data identical on every "
            "process."
        )


__all__ = ["StageFailure", "check_same_batch", "failure_key", "fingerprint", "reported"]
