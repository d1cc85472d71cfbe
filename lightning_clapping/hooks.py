"""The LightningModule's epoch-end hooks on a pipeline: where they run, and what they may call there.

``on_train_epoch_end``, ``on_validation_epoch_end`` and ``on_test_epoch_end`` read what the steps left on the
module (outputs kept in the steps exist on the last stage only: the earlier stages never run the code after their
cut), so with several stages they run on the last stage of each replica, and every other rank skips them. Inside
them:

* ``self.log`` (``sync_dist=True`` too) is recorded and replayed on every rank after the hook, like the steps' logs;
* ``self.all_gather``, ``strategy.reduce`` and torchmetrics' ``compute()`` go over the replicas, whose last stages
  all run the hook, so they work as under DDP;
* ``trainer.save_checkpoint(...)`` is recorded and run on every rank right after the hook (a checkpoint needs every
  stage's tensors), and ``trainer.should_stop = True`` reaches every rank;
* a collective of every process (``strategy.barrier()``, ``strategy.broadcast()``,
  ``strategy.reduce_boolean_decision()``) raises at once, naming the hook and the rule: the other stages would never
  join it.

Every rank learns what happened in the hook from one small all-reduce after it (whether it raised, whether it set
``should_stop``, the size of rank 0's recorded calls, then sent as JSON in one broadcast when there are any). A hook
that raises on a last stage makes every rank raise, instead of leaving the others waiting.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from lightning_clapping.stage_setup import Patches

EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")
#: the strategy's collectives over every process, refused inside an epoch-end hook
WORLD_COLLECTIVES = ("barrier", "broadcast", "reduce_boolean_decision")


def rule_message(hook: str, call: str) -> str:
    return (
        f"{hook} called {call}, a collective of every process, but under ClappingStrategy the LightningModule's "
        f"epoch-end hooks ({', '.join(EPOCH_END_HOOKS)}) run on the last pipeline stage only, where the steps' "
        f"outputs are: the other stages would never join it. Move this code into a Callback's {hook}, which runs on "
        "every process. Inside the LightningModule's hook, self.log (also with sync_dist=True), self.all_gather and "
        "trainer.save_checkpoint work as they are."
    )


@contextmanager
def recording_world_calls(hook: str, trainer: Any, calls: list[dict[str, Any]]) -> Generator[None, None, None]:
    """Inside the hook on a last stage: ``trainer.save_checkpoint`` records its call into ``calls`` (run on every
    rank afterwards), and the strategy's collectives of every process raise with the rule."""

    def save_checkpoint(filepath: Any, weights_only: bool | None = None, storage_options: Any = None) -> None:
        call = {"filepath": os.fspath(filepath), "weights_only": weights_only, "storage_options": storage_options}
        try:
            json.dumps(call)
        except TypeError as e:
            raise TypeError(f"trainer.save_checkpoint() in {hook} runs on every process after the hook, which "
                            f"needs its storage_options to be JSON data (None, numbers, strings, lists, dicts): {e}"
                            ) from None
        calls.append(call)

    def refuse(name: str) -> Callable[..., Any]:
        def refused(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(rule_message(hook, f"strategy.{name}()"))

        return refused

    patches = Patches()
    patches.set(trainer, "save_checkpoint", save_checkpoint)
    for name in WORLD_COLLECTIVES:
        patches.set(trainer.strategy, name, refuse(name))
    try:
        yield
    finally:
        patches.restore()


class EpochEndHooks:
    """Wraps the module's epoch-end hooks (see the module docstring). ``relay`` records the hook's logs
    (:class:`~lightning_clapping.log_relay.LogRelay`); ``relay_logs`` replays them on every rank (a collective of
    each pipeline)."""

    def __init__(self, module: Any, placement: Any, relay: Any, relay_logs: Callable[[], None]) -> None:
        self.module, self.placement, self.relay, self.relay_logs = module, placement, relay, relay_logs

    def wrap(self, hook: str, user_hook: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            self.relay.clear()
            if self.placement.num_stages == 1:  # every rank is a last stage and runs the hook
                with self.relay.capture(1):
                    user_hook()
                self.relay_logs()
                return
            trainer, calls, error = self.module.trainer, [], None
            stopping = trainer.should_stop
            if self.placement.is_last:
                with self.relay.capture(1), recording_world_calls(hook, trainer, calls):
                    try:
                        user_hook()
                    except Exception as e:  # every rank learns of it below, then raises
                        error = e
            self._after(hook, trainer, calls, error, stopping)

        return run

    def _after(self, hook: str, trainer: Any, calls: list[dict[str, Any]], error: Exception | None,
               stopping: bool) -> None:
        """Collective: every rank raises if a last stage's hook did, stops if one set ``should_stop``, and runs rank
        0's recorded ``save_checkpoint`` calls."""
        placement = self.placement
        payload = json.dumps(calls).encode() if placement.global_rank == 0 and calls else b""
        header = torch.tensor([placement.global_rank + 1 if error is not None else 0,
                               int(trainer.should_stop and not stopping), len(payload)],
                              dtype=torch.int64, device=placement.device)
        dist.all_reduce(header, op=dist.ReduceOp.MAX)
        failed, stop, size = header.tolist()
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"ClappingStrategy: the LightningModule's {hook} raised on global rank {failed - 1} "
                               "(a last pipeline stage); its error is in that process's output")
        if size:
            buffer = torch.zeros(size, dtype=torch.uint8, device=placement.device)
            if placement.global_rank == 0:
                buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            dist.broadcast(buffer, src=0)
            calls = json.loads(bytes(buffer.cpu().tolist()).decode())
        if stop:
            trainer.should_stop = True
        self.relay_logs()
        for call in calls if size else ():
            trainer.save_checkpoint(**call)
