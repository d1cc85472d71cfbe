"""The package's shape: the engine's sub-packages run without Lightning, and no room outgrows its job.

The top level of ``lightning_clapping`` is the Lightning side (strategy, data module, launcher, options); everything
below it (pipeline, comm, codecs, checkpoint, autotune, lazy) is plain torch, so the ``pytorch_lightning`` twin only
mirrors the top level and the engine can be read and tested without a Trainer.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "lightning_clapping"
BENCHMARKS_DIR = PACKAGE_DIR.parent / "benchmarks"
SUBPACKAGES = sorted(p.parent.name for p in PACKAGE_DIR.glob("*/__init__.py"))
LIGHTNING_ROOTS = ("lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities")


def _engine_modules() -> list[str]:
    out = []
    for sub in SUBPACKAGES:
        for path in sorted((PACKAGE_DIR / sub).rglob("*.py")):
            rel = path.relative_to(PACKAGE_DIR).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out.append(".".join(["lightning_clapping", *parts]))
    return out


def test_the_engine_has_sub_packages():
    assert {"pipeline", "comm", "codecs", "checkpoint", "autotune", "lazy"} <= set(SUBPACKAGES)


# Run in a fresh interpreter: the package's own __init__ (which registers the strategy with Lightning) is replaced
# by an empty package object, and any import of a Lightning package raises. Each engine module is then imported.
_PROBE = r"""
import importlib, importlib.abc, sys, types
ROOTS = {roots!r}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ROOTS:
            raise ImportError("engine module imported " + name)
        return None

sys.meta_path.insert(0, Refuse())
pkg = types.ModuleType("lightning_clapping")
pkg.__path__ = [{pkg_dir!r}]
sys.modules["lightning_clapping"] = pkg
failed = []
for name in {modules!r} + ["lightning_clapping._compat"]:
    try:
        importlib.import_module(name)
    except ImportError as e:
        failed.append(f"{{name}}: {{e}}")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ROOTS)
print("FAILED", failed)
print("LOADED", loaded)
"""


def test_engine_sub_packages_import_no_lightning():
    modules = _engine_modules()
    assert len(modules) > 20, modules
    code = _PROBE.format(roots=LIGHTNING_ROOTS, pkg_dir=str(PACKAGE_DIR), modules=modules)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FAILED []" in out.stdout, out.stdout
    assert "LOADED []" in out.stdout, out.stdout


@pytest.mark.parametrize("sub", SUBPACKAGES)
def test_engine_imports_from_the_package_only_engine_modules_and_torch_names_of_compat(sub):
    """A sub-package may use the top level only through ``_compat``'s torch names: the twin shares sub-packages, so
    a Lightning object reached from one would be ``lightning.pytorch``'s in a ``pytorch_lightning`` run too."""
    from lightning_clapping import _compat

    wrong = []
    for path in sorted((PACKAGE_DIR / sub).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_clapping"):
                parts = node.module.split(".")
                if parts == ["lightning_clapping"]:
                    bad = [a.name for a in node.names if a.name not in SUBPACKAGES]
                elif parts[1] == "_compat":
                    bad = [a.name for a in node.names if a.name in _compat.LIGHTNING_NAMES]
                else:
                    bad = [] if parts[1] in SUBPACKAGES else [node.module]
                wrong += [f"{path.relative_to(PACKAGE_DIR)}:{node.lineno} {b}" for b in bad]
            elif isinstance(node, ast.Import):
                wrong += [f"{path.relative_to(PACKAGE_DIR)}:{node.lineno} {a.name}" for a in node.names
                          if a.name.split(".")[0] in LIGHTNING_ROOTS
                          or (a.name.startswith("lightning_clapping.") and a.name.split(".")[1] not in SUBPACKAGES)]
    assert not wrong, wrong


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_no_module_of_the_package_is_over_500_lines():
    """strategy.py has its own bound below: its class docstring documents every argument for LightningCLI's help."""
    big = {str(p.relative_to(PACKAGE_DIR)): _lines(p) for p in PACKAGE_DIR.rglob("*.py")
           if _lines(p) > 500 and p.name != "strategy.py"}
    assert not big, big


def test_the_strategy_is_a_thin_adapter():
    assert _lines(PACKAGE_DIR / "strategy.py") <= 550


def test_no_benchmark_script_is_over_600_lines():
    big = {p.name: _lines(p) for p in BENCHMARKS_DIR.glob("*.py") if _lines(p) > 600}
    assert not big, big
