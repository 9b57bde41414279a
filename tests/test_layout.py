"""The package layout: each package imports only packages below it.

Imports are read from the source (``ast``), all of them: at module level, inside
functions (loaded lazily) and for type checking only, since each is a dependency a reader
has to follow. A *unit* is a package (``fusestate.meta.postgres``) or a module directly
under ``fusestate`` (``fusestate.config``). Every unit has a layer in ``LAYERS``; a unit
may import units of lower layers only, so two units of one layer (the metadata engines)
never import each other, nothing imports upward, and there is no cycle. A new package
fails here until it is given its place.
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path
from typing import Iterable, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Bottom-up. A unit imports only units of lower layers.
LAYERS: list[set[str]] = [
    {"fusestate", "fusestate.errors", "fusestate.localio", "fusestate.namespaces", "fusestate.read_trace",
     "fusestate.sst"},
    {"fusestate.remote", "fusestate.harness"},
    {"fusestate.config"},
    {"fusestate.blocks"},
    {"fusestate.meta"},  # the contract and what every engine shares
    {"fusestate.meta.embedded", "fusestate.meta.postgres", "fusestate.meta.scratch"},
    {"fusestate.vfs"},
    {"fusestate.fuse"},
    {"fusestate.daemon"},
    {"fusestate.maintenance", "fusestate.spark"},
    {"fusestate.cli"},
    {"fusestate.__main__"},
]

Graph = dict[str, set[str]]


def module_names(root: Path, package: str = "fusestate") -> dict[str, Path]:
    out = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def unit_of(module: str, packages: set[str]) -> str:
    if module in packages:
        return module
    parent = module.rsplit(".", 1)[0]
    return module if parent == "fusestate" else parent


def _imported(node: ast.AST, modules: dict[str, Path]) -> Iterable[str]:
    """The modules of ``fusestate`` one import statement names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # ``from a import b``: b is a module of its own, or a name in a
        names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                 for a in node.names]
    else:
        return []
    found = []
    for name in names:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules:
            found.append(name)
    return found


def import_graph(root: Path) -> Graph:
    """unit -> the other units it imports."""
    modules = module_names(root)
    packages = {m for m, p in modules.items() if p.name == "__init__.py"}
    graph: Graph = collections.defaultdict(set)
    for module, path in modules.items():
        unit = unit_of(module, packages)
        graph.setdefault(unit, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _imported(node, modules):
                other = unit_of(target, packages)
                if other != unit:
                    graph[unit].add(other)
    return dict(graph)


def find_cycle(graph: Graph) -> Optional[list[str]]:
    """A cycle of units (first unit repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(unit: str) -> Optional[list[str]]:
        state[unit] = 1
        path.append(unit)
        for other in sorted(graph.get(unit, ())):
            if state.get(other) == 1:
                return path[path.index(other):] + [other]
            if other not in state and (cycle := visit(other)):
                return cycle
        path.pop()
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state and (cycle := visit(unit)):
            return cycle
    return None


def layer_violations(graph: Graph, layers: list[set[str]]) -> list[str]:
    """Units without a layer, and imports of a unit of the same or a higher layer."""
    level = {unit: i for i, units in enumerate(layers) for unit in units}
    problems = [f"{unit} has no layer in LAYERS" for unit in sorted(graph) if unit not in level]
    for unit, others in sorted(graph.items()):
        for other in sorted(others):
            if unit in level and other in level and level[other] >= level[unit]:
                problems.append(f"{unit} imports {other} (layer {level[other]}, not below {level[unit]})")
    return problems


def test_no_import_cycle_between_packages() -> None:
    assert find_cycle(import_graph(ROOT)) is None


def test_each_package_imports_only_packages_below_it() -> None:
    assert layer_violations(import_graph(ROOT), LAYERS) == []


def test_blocks_know_nothing_of_the_metadata() -> None:
    assert not {u for u in import_graph(ROOT)["fusestate.blocks"] if u.startswith("fusestate.meta")}


# --- the checks themselves fail when they should ------------------------------------------

def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in {"fusestate/__init__.py": "", **files}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "fusestate/blocks/__init__.py": "",
        "fusestate/blocks/store.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from fusestate.meta.engine import MetaEngine\n",
        "fusestate/meta/__init__.py": "",
        "fusestate/meta/engine.py": "from fusestate.blocks import store\n",
    })
    graph = import_graph(root)
    assert graph == {"fusestate": set(), "fusestate.blocks": {"fusestate.meta"},
                     "fusestate.meta": {"fusestate.blocks"}}
    assert find_cycle(graph) in (["fusestate.blocks", "fusestate.meta", "fusestate.blocks"],
                                 ["fusestate.meta", "fusestate.blocks", "fusestate.meta"])
    assert layer_violations(graph, LAYERS) == ["fusestate.blocks imports fusestate.meta (layer 4, not below 3)"]


def test_engines_of_one_layer_may_not_import_each_other(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "fusestate/meta/__init__.py": "",
        "fusestate/meta/postgres/__init__.py": "",
        "fusestate/meta/embedded/__init__.py": "",
        "fusestate/meta/postgres/engine.py": "def f():\n    import fusestate.meta.embedded.engine\n",
        "fusestate/meta/embedded/engine.py": "from fusestate.meta import engine\n",
        "fusestate/meta/engine.py": "",
        "fusestate/newthing/__init__.py": "",
    })
    problems = layer_violations(import_graph(root), LAYERS)
    assert problems == ["fusestate.newthing has no layer in LAYERS",
                        "fusestate.meta.postgres imports fusestate.meta.embedded (layer 5, not below 5)"]


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": set()}, None),
])
def test_a_cycle_is_found(graph: Graph, cycle: Optional[list[str]]) -> None:
    assert find_cycle(graph) == cycle
