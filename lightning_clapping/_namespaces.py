"""The ``pytorch_lightning`` twin of this package, and the strategy name registered in both Lightnings.

Lightning ships the same code under two namespaces: ``lightning.pytorch`` (package ``lightning``) and
``pytorch_lightning`` (package ``pytorch-lightning``, with ``lightning_fabric`` for ``lightning.fabric``). Their
classes are distinct, so a strategy written against one is refused by the other's ``Trainer``, and merely making it
pass the other's ``isinstance`` checks is not enough: the strategy base classes themselves assert their own
namespace's ``LightningModule`` (``Strategy.optimizer_step``, ``is_overridden``, ...).

So the package is mirrored the way Lightning builds ``pytorch_lightning`` from its own source: every module of this
package that imports ``lightning.pytorch`` / ``lightning.fabric`` (directly, or through another such module of this
package) is compiled a second time from the same file, with those imports renamed to ``pytorch_lightning`` /
``lightning_fabric``, as ``lightning_clapping.pytorch_lightning.<module>``. Modules that do not touch Lightning
(codecs, wire format, schedules, partitioning, ...) are shared, so e.g. a codec added with ``register_codec`` is
seen by both. The twin is built on first use (importing it, or ``strategy="clapping"`` in a ``pytorch_lightning``
Trainer), not by ``import lightning_clapping``.

    import pytorch_lightning as pl
    from lightning_clapping.pytorch_lightning import ClappingStrategy   # or strategy="clapping"

    trainer = pl.Trainer(devices=2, strategy=ClappingStrategy(split_points=["net.4"]))

``register()`` (called by ``import lightning_clapping``) registers ``strategy="clapping"`` in
``lightning.pytorch``'s registry and, when ``pytorch_lightning`` is installed, in its registry too (that imports
``pytorch_lightning``, about 0.1 s once ``lightning`` is loaded; the twin itself is compiled only when a
``pytorch_lightning`` Trainer asks for the name).
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

PACKAGE = "lightning_clapping"
TWIN = f"{PACKAGE}.pytorch_lightning"
STRATEGY_NAME = "clapping"
DESCRIPTION = "Pipeline-parallel training with compressed inter-stage messages"

#: Lightning's own rule for producing ``pytorch_lightning`` from ``lightning.pytorch`` (prefix -> replacement).
RENAMES = {"lightning.pytorch": "pytorch_lightning", "lightning.fabric": "lightning_fabric"}
_STRING_RENAME = re.compile(r"\blightning\.(pytorch|fabric)\b")
_NOT_MIRRORED = {"__init__", "_namespaces"}
_PACKAGE_DIR = Path(__file__).resolve().parent


class TwinError(ImportError):
    """A module of this package uses Lightning in a form the mirror cannot rename."""


# ---------------------------------------------------------------------------------------------- which modules
def _rename(module: str) -> str | None:
    """``lightning.pytorch.x`` -> ``pytorch_lightning.x``; None if ``module`` is not under a renamed prefix."""
    for old, new in RENAMES.items():
        if module == old or module.startswith(old + "."):
            return new + module[len(old):]
    return None


def _absolute(node: ast.ImportFrom) -> str:
    """The absolute module of a ``from ... import`` inside a module of this package."""
    if not node.level:
        return node.module or ""
    base = PACKAGE.split(".")
    if node.level > 1:
        base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _own_submodule(module: str) -> str | None:
    """``lightning_clapping.data.x`` -> ``data``; None for anything else."""
    if module.startswith(PACKAGE + "."):
        return module[len(PACKAGE) + 1:].split(".")[0]
    return None


def _module_level_bindings(body: list[ast.stmt]) -> tuple[set[str], set[str]]:
    """(names bound at module level, those of them bound only by imports from outside Lightning and this package)."""
    bound: set[str] = set()
    other: set[str] = set()  # bound by a definition, an assignment, or an import from Lightning or this package
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(stmt.name)
            other.add(stmt.name)
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            module = _absolute(stmt) if isinstance(stmt, ast.ImportFrom) else None
            for alias in stmt.names:
                name = (alias.asname or alias.name).split(".")[0]
                source = module if module is not None else alias.name
                bound.add(name)
                if _rename(source) is not None or source == "lightning" or source.split(".")[0] == PACKAGE:
                    other.add(name)
        else:
            for node in ast.walk(stmt):  # assignments, and the statements inside if / try / with / for
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    bound.add(node.id)
                    other.add(node.id)
            inner = [x for field in ("body", "orelse", "finalbody") for x in getattr(stmt, field, None) or []]
            inner += [x for handler in getattr(stmt, "handlers", None) or [] for x in handler.body]
            b, f = _module_level_bindings([x for x in inner if isinstance(x, ast.stmt)])
            bound |= b
            other |= b - f
    return bound, bound - other


class _Imports:
    """What one module of this package imports (module level and inside functions alike)."""

    def __init__(self, path: Path) -> None:
        self.lightning = False  # imports lightning.pytorch / lightning.fabric itself
        self.modules: set[str] = set()  # our modules it imports whole (`from lightning_clapping import _compat`)
        self.names: set[tuple[str, str]] = set()  # (our module, name) it imports from them
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        # module-level names, and those a third party (torch, ...) provides: the same object in both namespaces
        self.bound, self.foreign = _module_level_bindings(tree.body)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.lightning |= _rename(alias.name) is not None or alias.name == "lightning"
                    if _own_submodule(alias.name):
                        self.modules.add(_own_submodule(alias.name))
            elif isinstance(node, ast.ImportFrom):
                module = _absolute(node)
                if _rename(module) is not None or module == "lightning":
                    self.lightning = True
                elif module == PACKAGE:
                    self.modules.update(a.name for a in node.names)
                elif _own_submodule(module):
                    self.names.update((_own_submodule(module), a.name) for a in node.names)


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(_PACKAGE_DIR.glob("*.py")) if p.stem not in _NOT_MIRRORED}


_mirrored_cache: frozenset[str] | None = None


def mirrored_modules() -> frozenset[str]:
    """The modules that need a ``pytorch_lightning`` copy.

    A module is mirrored if it imports Lightning, imports a mirrored module of ours whole, or imports from one a
    name that the mirrored module defines or takes from Lightning (a name it merely re-exports from a third party,
    like ``_compat.tree_flatten`` from torch, or does not have at all, is the same object in both: sharing is fine).
    """
    global _mirrored_cache
    if _mirrored_cache is None:
        scanned = {name: _Imports(path) for name, path in _modules().items()}
        mirrored = {name for name, imports in scanned.items() if imports.lightning}
        grew = True
        while grew:
            grew = False
            for name, imports in scanned.items():
                if name in mirrored:
                    continue
                if imports.modules & mirrored or any(
                    m in mirrored and n in scanned[m].bound and n not in scanned[m].foreign for m, n in imports.names
                ):
                    mirrored.add(name)
                    grew = True
        _mirrored_cache = frozenset(mirrored)
    return _mirrored_cache


# ---------------------------------------------------------------------------------------------- the rewrite
class _Mirror(ast.NodeTransformer):
    """Renames Lightning imports, and imports of mirrored modules of this package, to their twins."""

    def __init__(self, name: str, mirrored: frozenset[str]) -> None:
        self.name = name
        self.mirrored = mirrored

    def _fail(self, node: ast.AST, what: str) -> None:
        raise TwinError(
            f"{PACKAGE}/{self.name}.py line {getattr(node, 'lineno', '?')}: {what} cannot be mirrored for "
            f"pytorch_lightning; import from lightning.pytorch / lightning.fabric with an explicit name instead "
            f"(e.g. `import lightning.pytorch as pl`, `from lightning.pytorch import Trainer`)."
        )

    def _own(self, module: str) -> str:
        sub = _own_submodule(module)
        if sub in self.mirrored:
            return f"{TWIN}.{module[len(PACKAGE) + 1:]}"
        return module

    def visit_Import(self, node: ast.Import) -> ast.AST:
        for alias in node.names:
            new = _rename(alias.name)
            if alias.name == "lightning" or (new is not None and alias.asname is None):
                self._fail(node, f"`import {alias.name}` (binds the name `lightning`)")
            if new is not None:
                alias.name = new
            elif _own_submodule(alias.name) in self.mirrored:
                if alias.asname is None:
                    self._fail(node, f"`import {alias.name}` (binds the name `{PACKAGE}`)")
                alias.name = self._own(alias.name)
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST:
        module = _absolute(node)
        if module == "lightning":
            self._fail(node, "`from lightning import ...`")
        new = _rename(module)
        if new is not None:
            node.module, node.level = new, 0
            return node
        if module == PACKAGE:  # from lightning_clapping import x: the twin package resolves x (twin or shared)
            node.module, node.level = TWIN, 0
            return node
        if _own_submodule(module):
            node.module, node.level = self._own(module), 0
        return node

    def visit_Constant(self, node: ast.Constant) -> ast.AST:
        # messages and docstrings name the namespace the user has (e.g. `python -m pytorch_lightning.utilities...`)
        if isinstance(node.value, str):
            node.value = _STRING_RENAME.sub(lambda m: RENAMES[m.group(0)], node.value)
        return node


def mirrored_code(name: str) -> Any:
    """The code object of ``lightning_clapping.<name>`` with Lightning renamed (line numbers kept)."""
    path = _modules()[name]
    tree = _Mirror(name, mirrored_modules()).visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    ast.fix_missing_locations(tree)
    return compile(tree, str(path), "exec", dont_inherit=True)


# ---------------------------------------------------------------------------------------------- the importer
def _public(name: str) -> Any:
    """``lightning_clapping.pytorch_lightning.<name>``: the twin of a public object, or the shared one."""
    root = importlib.import_module(PACKAGE)
    if name in getattr(root, "__all__", ()) or name == "__version__":
        obj = getattr(root, name)
        home = _own_submodule(getattr(obj, "__module__", "") or "")
        if home in mirrored_modules():
            return getattr(importlib.import_module(f"{TWIN}.{home}"), name)
        return obj
    shared = (_PACKAGE_DIR / f"{name}.py").is_file() or (_PACKAGE_DIR / name / "__init__.py").is_file()
    if shared and name not in mirrored_modules():
        return importlib.import_module(f"{PACKAGE}.{name}")  # a shared module, for `from ... import codecs`
    raise AttributeError(f"module {TWIN!r} has no attribute {name!r}")


class _TwinLoader(importlib.abc.Loader):
    def __init__(self, name: str | None, origin: str | None) -> None:
        self.name, self.origin = name, origin

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        if self.name is None:  # the twin package: public names resolve lazily
            module.__doc__ = (f"{PACKAGE} for `import pytorch_lightning` (the same code, mirrored; see "
                              f"{PACKAGE}._namespaces).")
            names = list(getattr(importlib.import_module(PACKAGE), "__all__", ()))
            vars(module).update(__getattr__=_public, __all__=names,
                                __dir__=lambda: sorted(set(names) | set(vars(module))))
            return
        exec(mirrored_code(self.name), module.__dict__)

    def get_filename(self, fullname: str) -> str | None:  # for tools that look for the source
        return self.origin


class _TwinFinder(importlib.abc.MetaPathFinder):
    """Finds ``lightning_clapping.pytorch_lightning`` and its mirrored modules (nothing else)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname == TWIN:
            spec = importlib.machinery.ModuleSpec(fullname, _TwinLoader(None, None), is_package=True)
            spec.submodule_search_locations = []
            return spec
        if not fullname.startswith(TWIN + "."):
            return None
        name = fullname[len(TWIN) + 1:]
        if "." in name or name not in mirrored_modules():
            return None
        origin = str(_modules()[name])
        spec = importlib.machinery.ModuleSpec(fullname, _TwinLoader(name, origin), origin=origin)
        spec.has_location = True
        return spec


FINDER = _TwinFinder()


def install_finder() -> None:
    if not any(isinstance(f, _TwinFinder) for f in sys.meta_path):
        sys.meta_path.append(FINDER)


# ---------------------------------------------------------------------------------------------- registration
def _twin_strategy(**kwargs: Any) -> Any:
    """What ``pytorch_lightning``'s registry builds for ``strategy="clapping"`` (compiles the twin on first use)."""
    return importlib.import_module(f"{TWIN}.strategy").ClappingStrategy(**kwargs)


def register_pytorch_lightning() -> bool:
    """Register ``strategy="clapping"`` with ``pytorch_lightning`` if it is installed (False if it is not)."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        return False
    from pytorch_lightning.strategies import StrategyRegistry

    if STRATEGY_NAME not in StrategyRegistry:
        StrategyRegistry.register(STRATEGY_NAME, _twin_strategy, description=DESCRIPTION)
    return True


def register() -> None:
    """Everything ``import lightning_clapping`` sets up: both registries and the twin's importer."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_clapping.strategy import ClappingStrategy

    if STRATEGY_NAME not in StrategyRegistry:
        ClappingStrategy.register_strategies(StrategyRegistry)
    install_finder()
    register_pytorch_lightning()
