"""The whiteboard of parts, enforced: which part of the package may import which.

Parts: the core (``prefixcache._core``, the Rust extension), the typed API (the package root:
``prefixcache``, ``prefixcache.config``, ``prefixcache.events``, ``prefixcache.metrics``), the
kernels (``prefixcache.kernels``), the models
(``prefixcache.models``) and the engine (``prefixcache.engine``: the reference engine, the
workloads and the ``prefixcache`` command; the root ``__main__`` only starts that command).
The engine uses the models, the kernels and the API; the models use the kernels; the kernels
may use the API. Never kernels -> engine, models -> engine, kernels -> models, nor the API ->
any of the three. Every import statement counts, those inside functions and ``TYPE_CHECKING``
blocks included: a lazy import is still an edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("prefixcache._core")

import prefixcache

PACKAGE = Path(prefixcache.__file__).resolve().parent

ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "api": {"core"},
    "kernels": {"api", "core"},
    "models": {"kernels", "api", "core"},
    "engine": {"models", "kernels", "api", "core"},
}
FORBIDDEN = {
    ("kernels", "engine"),
    ("models", "engine"),
    ("kernels", "models"),
    ("api", "kernels"),
    ("api", "models"),
    ("api", "engine"),
}
# The only modules at the package root: the typed API (with its event publisher and metrics
# collector, which depend on nothing but the API), the extension's stub and the
# ``python -m prefixcache`` entry point. The simulator's pieces live in the engine's part.
ROOT_MODULES = {"__init__", "config", "_core", "__main__", "events", "metrics"}


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def part_of(module: str) -> str | None:
    """The part a ``prefixcache`` module belongs to (``None`` outside the package)."""
    names = module.split(".")
    if names[0] != "prefixcache":
        return None
    if len(names) > 1 and names[1] in ("kernels", "models", "engine"):
        return names[1]
    if len(names) > 1 and names[1] == "_core":
        return "core"
    if len(names) > 1 and names[1] == "__main__":
        return "engine"
    # The root package, prefixcache.config, or a name imported from the root
    # (``from prefixcache import PlanBuffers``).
    return "api"


def imported_modules(path: Path, package_dir: Path = PACKAGE) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in the file, relative imports resolved."""
    module = module_name(path, package_dir)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                assert node.module is not None
                target = node.module
            found.append((node.lineno, target))
            # ``from .. import engine`` imports a part by name.
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def edges() -> dict[tuple[str, str], list[str]]:
    """Part -> part edges between different parts, each with where it is written."""
    result: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        source = part_of(module_name(path))
        assert source is not None
        for line, target_module in imported_modules(path):
            target = part_of(target_module)
            if target is None or target == source:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {target_module}"
            result.setdefault((source, target), []).append(where)
    return result


def test_every_module_belongs_to_a_part_and_the_root_holds_only_the_api() -> None:
    root = {path.stem for path in PACKAGE.iterdir() if path.suffix in (".py", ".pyi")}
    assert root <= ROOT_MODULES, (
        f"modules at the package root outside the API: {root - ROOT_MODULES}"
    )
    parts = {part_of(module_name(path)) for path in PACKAGE.rglob("*.py")}
    assert parts == {"api", "kernels", "models", "engine"}


def test_no_part_imports_a_part_it_must_not() -> None:
    found = edges()
    forbidden = {edge: found[edge] for edge in FORBIDDEN if edge in found}
    assert not forbidden, f"forbidden imports: {forbidden}"
    unexpected = {edge: where for edge, where in found.items() if edge[1] not in ALLOWED[edge[0]]}
    assert not unexpected, f"imports outside the whiteboard: {unexpected}"
    # The test sees the edges that exist: the engine uses the models and the kernels, the
    # models use the kernels.
    assert {("engine", "models"), ("engine", "kernels"), ("models", "kernels")} <= set(found)


def test_the_edge_finder_resolves_relative_and_lazy_imports(tmp_path: Path) -> None:
    # The finder itself must be able to fail: a relative import of the engine from a kernel
    # module, written inside a function, is an edge kernels -> engine.
    source = "def f():\n    from ..engine import Engine\n    from .. import models\n"
    tree_path = tmp_path / "prefixcache" / "kernels" / "probe.py"
    tree_path.parent.mkdir(parents=True)
    tree_path.write_text(source, encoding="utf-8")
    found = [
        module
        for _, module in imported_modules(tree_path, tmp_path / "prefixcache")
        if part_of(module) in ("engine", "models")
    ]
    assert found == ["prefixcache.engine", "prefixcache.engine.Engine", "prefixcache.models"]


def test_the_kernels_import_on_their_own() -> None:
    code = (
        "import sys\n"
        "import prefixcache.kernels\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('prefixcache.engine', "
        "'prefixcache.models')))\n"
        "print(bad)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
