"""The machine description every benchmark prints and saves next to its results."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe(**extra: object) -> dict:
    """CPU model, logical CPUs, Python and torch versions (and Lightning's when installed), plus ``extra``."""
    import torch  # imported here so that cpu_model() stays usable without torch

    out: dict[str, object] = {"cpu": cpu_model(), "logical_cpus": torch.multiprocessing.cpu_count(),
                              "python": platform.python_version(), "torch": torch.__version__,
                              "platform": platform.platform()}
    try:
        import lightning

        out["lightning"] = lightning.__version__
    except ImportError:
        pass
    out.update(extra)
    return out
