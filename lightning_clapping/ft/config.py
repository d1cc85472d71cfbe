"""What a fault-tolerant run needs to know: where the lighthouse is, which replica group this job is, how many there
are, and how long to wait. Unset fields are read from torchft's environment variables when the run starts."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

INSTALL_HINT = 'pip install "torchft==0.2.0"  (or: pip install -e ".[ft]")'
#: environment variables read for the fields left unset (the names torchft's examples use)
ENV = {"lighthouse": "TORCHFT_LIGHTHOUSE", "replica_group": "REPLICA_GROUP_ID",
       "num_replica_groups": "NUM_REPLICA_GROUPS"}


@dataclass(frozen=True)
class FaultTolerance:
    """``ClappingStrategy(fault_tolerance=FaultTolerance(...))``, or ``fault_tolerance="torchft"`` for all defaults.

    Args:
        lighthouse: the torchft lighthouse's address, e.g. ``"http://10.0.0.1:29510"`` (default: ``$TORCHFT_LIGHTHOUSE``).
        replica_group: this job's replica group, ``0 .. num_replica_groups - 1`` (default: ``$REPLICA_GROUP_ID``).
            It chooses the group's shard of the training data and names the group to the lighthouse.
        num_replica_groups: how many replica groups the data is sharded over (default: ``$NUM_REPLICA_GROUPS``). It
            is fixed for the run: while a group is down, its shard is not trained on.
        min_replicas: the fewest live groups a step may commit with.
        timeout: how long a cross-group all-reduce, a commit vote or a state fetch may take before the step is
            dropped (a peer that died mid-step fails it at once; this bounds a peer that hangs).
        quorum_timeout: how long a step waits for a quorum of groups.
        init_sync: at the first step every group takes the weights of one of them (leave on unless every group is
            seeded alike).
        host: the name or address the other groups reach this one's processes on (default: the host name, as
            torchft's managers advertise themselves; set it where the host name does not resolve across machines).
    """

    lighthouse: str | None = None
    replica_group: int | None = None
    num_replica_groups: int | None = None
    min_replicas: int = 1
    timeout: timedelta = timedelta(seconds=60)
    quorum_timeout: timedelta = timedelta(seconds=60)
    init_sync: bool = True
    host: str | None = None

    def resolved(self, environ: Any = None) -> FaultTolerance:
        """The same settings with the unset ones read from the environment; raises with what to set."""
        environ = os.environ if environ is None else environ
        values = {}
        for name, var in ENV.items():
            value = getattr(self, name)
            if value is None:
                if not environ.get(var):
                    raise ValueError(
                        f"fault_tolerance needs {name}: set ${var} in the environment of every process of this "
                        f"replica group, or pass FaultTolerance({name}=...). See docs/fault_tolerance.md for the "
                        "launch commands."
                    )
                value = environ[var]
            values[name] = value
        try:
            group, groups = int(values["replica_group"]), int(values["num_replica_groups"])
        except ValueError:
            raise ValueError(f"replica_group and num_replica_groups must be integers, got "
                             f"{values['replica_group']!r} and {values['num_replica_groups']!r}") from None
        if groups < 1 or not 0 <= group < groups:
            raise ValueError(f"replica_group must lie in 0 .. num_replica_groups - 1, got replica_group={group}, "
                             f"num_replica_groups={groups}")
        return replace(self, lighthouse=str(values["lighthouse"]), replica_group=group, num_replica_groups=groups)


def resolve(value: Any) -> FaultTolerance | None:
    """The strategy's ``fault_tolerance`` argument, checked: ``None``, ``"torchft"`` or a :class:`FaultTolerance`.
    torchft must be importable (the error says how to install it)."""
    if value is None or value is False:
        return None
    if value == "torchft" or value is True:
        value = FaultTolerance()
    if not isinstance(value, FaultTolerance):
        raise TypeError(f"fault_tolerance must be None, 'torchft' or a lightning_clapping.FaultTolerance, got {value!r}")
    for name in ("timeout", "quorum_timeout"):
        t = getattr(value, name)
        if not isinstance(t, timedelta) or t.total_seconds() <= 0:
            raise ValueError(f"FaultTolerance.{name} must be a positive datetime.timedelta, got {t!r}")
    if not isinstance(value.min_replicas, int) or value.min_replicas < 1:
        raise ValueError(f"FaultTolerance.min_replicas must be a positive integer, got {value.min_replicas!r}")
    try:
        import torchft  # noqa: F401
    except ImportError as err:
        raise ImportError(f"fault_tolerance='torchft' needs the torchft package ({err}): {INSTALL_HINT}") from None
    return value
