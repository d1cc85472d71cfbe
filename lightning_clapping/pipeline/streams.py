"""Torch's random streams across the stages of one pipeline.

Every stage runs the user's step, but each runs other modules, so each stage's generator moves differently. Two ways
keep the stages' random numbers those of one process:

* **Values drawn in the step** (noise, masks, permutations drawn in ``training_step`` or the parent's ``forward``)
  are sent from the stage that draws them to every later stage that uses them
  (:mod:`lightning_clapping.pipeline.crossings`). That holds under both settings below.
* **The generator's state itself**, with ``freeze_rng=False``: a stage's state when it leaves its part of a
  micro-batch's forward travels with its forward message, and the next stage takes it at its entry
  (:class:`Handoff`), so the next stage's modules draw what one process would draw there. At the end of a step every
  stage takes the last stage's state, so the next step (and the data loader's draws between epochs) starts from the
  same state everywhere. With one micro-batch per step the pipeline then draws exactly the numbers one process draws.

With ``freeze_rng=True`` (the default) each micro-batch's forward runs under a seed of its own
(:class:`frozen_rng`), so the masks repeat while lazy sampling reuses a batch, and the surrounding stream is put back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _device_index(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


class frozen_rng:
    """Seed torch's RNG for one micro-batch's forward and restore the surrounding streams afterwards.

    Both the CPU generator and, on a CUDA device, that device's own generator (where dropout on the GPU draws from)
    are seeded and restored; the generators of other devices are left alone.
    """

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        self.index = _device_index(device)

    def __enter__(self):
        self._cpu_state = torch.get_rng_state()
        torch.random.default_generator.manual_seed(self.seed)
        if self.index is not None:
            self._cuda_state = torch.cuda.get_rng_state(self.index)
            with torch.cuda.device(self.index):
                torch.cuda.manual_seed(self.seed)
        return self

    def __exit__(self, *exc):
        torch.set_rng_state(self._cpu_state)
        if self.index is not None:
            torch.cuda.set_rng_state(self._cuda_state, self.index)
        return False


def state_bytes(device: torch.device) -> bytes:
    """The CPU generator's state, then the stage device's generator's (on CUDA), as bytes."""
    parts = [torch.get_rng_state()]
    index = _device_index(device)
    if index is not None:
        parts.append(torch.cuda.get_rng_state(index))
    return b"".join(p.numpy().tobytes() for p in parts)


def set_state_bytes(blob: bytes, device: torch.device, where: str) -> None:
    """Take the states :func:`state_bytes` gave on another stage (of the same torch and device type)."""
    cpu = torch.get_rng_state().numel()
    index = _device_index(device)
    cuda = torch.cuda.get_rng_state(index).numel() if index is not None else 0
    if len(blob) != cpu + cuda:
        raise RuntimeError(f"{where}: the random generator state has {len(blob)} bytes, expected {cpu + cuda}: the "
                           "stages run different torch versions or devices")
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    torch.set_rng_state(data[:cpu].clone())
    if index is not None:
        torch.cuda.set_rng_state(data[cpu:].clone(), index)


class Handoff:
    """With ``freeze_rng=False`` (``enabled``), on a pipeline of several stages: the generator state a stage has at its
    exit of each micro-batch, for the forward message (:meth:`leave`, :meth:`outgoing`); the state the next stage
    takes at its entry (:meth:`enter`); and the last stage's state after a step, which every stage takes
    (:meth:`with_state` and :meth:`take_last_stage` for a training step, :meth:`share_last_stage` for an evaluation
    step). Disabled, every method does nothing."""

    def __init__(self, device: torch.device, stage: int, enabled: bool) -> None:
        self.device = device
        self.stage = stage
        self.enabled = enabled
        self._left: dict[int, bytes] = {}

    def leave(self, j: int) -> None:
        if self.enabled:
            self._left[j] = state_bytes(self.device)

    def outgoing(self, j: int) -> bytes | None:
        return self._left.pop(j) if self.enabled else None

    def enter(self, blob: bytes, j: int) -> None:
        set_state_bytes(blob, self.device, f"stage {self.stage}, micro-batch {j}")

    def with_state(self, results: bytes) -> bytes:
        """On the last stage: the step's results followed by its generator state."""
        return results + state_bytes(self.device) if self.enabled else results

    def take_last_stage(self, results: bytes | None) -> bytes | None:
        """On the other stages, after a training step: the last stage's state off the end of the results that came
        back (which are returned without it) becomes this stage's."""
        if not self.enabled or results is None:
            return results
        size = len(state_bytes(self.device))
        set_state_bytes(results[-size:], self.device, f"stage {self.stage}, end of the step")
        return results[:-size]

    def share_last_stage(self, src: int, group: Any, is_last: bool) -> None:
        """After an evaluation step: the last stage's (global rank ``src``) state on every stage, with one broadcast
        over the pipeline's ``group`` (evaluation sends nothing backward for it to ride on)."""
        if not self.enabled:
            return
        state = torch.frombuffer(bytearray(state_bytes(self.device)), dtype=torch.uint8).to(self.device)
        dist.broadcast(state, src=src, group=group)
        if not is_last:
            set_state_bytes(state.cpu().numpy().tobytes(), self.device, f"stage {self.stage}, evaluation")


__all__ = ["Handoff", "frozen_rng", "set_state_bytes", "state_bytes"]
