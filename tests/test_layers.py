"""The layers import one way only: schemas <- eventlog <- snapshotter <- replayer <- rewind.

Every import statement of every module is read (module level and inside functions), so a
lazy upward import fails here as surely as a top-level one; no modules import each other in
a circle, even under ``TYPE_CHECKING``. The same reading checks that
only ``eventlog.settings`` reads the environment, and that every runtime dependency is
imported by the package.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["schemas", "eventlog", "snapshotter", "replayer", "rewind"]


def _imported(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def _upward(layer: str) -> list[str]:
    rank = LAYERS.index(layer)
    above = set(LAYERS[rank + 1:])
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for line, module in _imported(path):
            top = module.split(".")[0]
            if module.startswith("."):
                bad.append(f"{path.relative_to(ROOT)}:{line}: relative import {module}")
            elif top in above:
                bad.append(f"{path.relative_to(ROOT)}:{line}: {layer} imports {module}")
    return bad


@pytest.mark.parametrize("layer", LAYERS)
def test_no_layer_imports_a_layer_above_it(layer: str) -> None:
    assert _upward(layer) == []


def test_the_check_finds_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from replayer.replay import replay\n    return replay\n")
    assert _imported(bad) == [(2, "replayer.replay")]


def _module_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """Each module of ``packages`` (under ``root``) and the modules of theirs it imports
    (``from a import b`` imports module ``a.b`` where there is one)."""
    paths = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            paths[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        # A module's own packages are imported before it: they are no edge of a circle.
        graph[name] = {m for m in found if m in paths and m != name and not name.startswith(m + ".")}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(members) > 1:
                found.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert _circles(_module_graph(ROOT, LAYERS)) == []


def test_the_check_finds_a_circle(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg import b\n")
    (tmp_path / "pkg" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                           "    from pkg.a import x\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    assert _circles(_module_graph(tmp_path, ["pkg"])) == [["pkg.a", "pkg.b"]]


def test_rewind_lists_the_documented_api() -> None:
    import rewind

    for name in ("Recorder", "Follower", "RunAddress", "RewindError", "replay", "export",
                 "every_versions", "keep_last"):
        assert name in rewind.__all__
        assert getattr(rewind, name) is not None


#: Product modules that may read the process environment, and why.
READS_ENVIRONMENT = {
    # The one door: Settings (read once), Deployment (at each use) and host_variable.
    "eventlog/settings.py",
}
_ENVIRONMENT_NAMES = {"environ", "environb", "getenv", "getenvb"}


def _environment_reads(path: Path) -> list[str]:
    """Each place ``path`` touches the process environment (``os.environ``, ``os.getenv``,
    or those names imported from ``os``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _ENVIRONMENT_NAMES:
            found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in ("os", "posix", "nt"):
            found += [f"{node.lineno}: from {node.module} import {alias.name}"
                      for alias in node.names if alias.name in _ENVIRONMENT_NAMES]
    return found


def test_only_the_settings_module_reads_the_environment() -> None:
    bad = [f"{path.relative_to(ROOT)}:{read}"
           for layer in LAYERS for path in sorted((ROOT / layer).rglob("*.py"))
           if path.relative_to(ROOT).as_posix() not in READS_ENVIRONMENT
           for read in _environment_reads(path)]
    assert bad == [], "read the environment through eventlog.settings"


def test_the_check_finds_an_environment_read(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom os import getenv\n\ndef f():\n    return os.environ.get('X')\n")
    assert _environment_reads(bad) == ["2: from os import getenv", "5: .environ"]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_runtime_dependency_is_imported_by_the_package() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_normalized(re.split(r"[<>=!~ \[;]", spec, maxsplit=1)[0]) for spec in project["dependencies"]}
    provides: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(_normalized(dist), set()).add(module)
    imported = {module.split(".")[0] for layer in LAYERS for path in (ROOT / layer).rglob("*.py")
                for _, module in _imported(path)}
    unused = sorted(dist for dist in wanted if not provides.get(dist, set()) & imported)
    assert unused == [], "runtime dependencies no product module imports (move them to an extra)"
