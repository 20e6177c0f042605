"""No import cycle between any two modules of `eldr` and `eldr_services`.

`make lint` checks the layers and the sibling cycles (`lint-imports`, contracts in
pyproject.toml); this test adds the cycles no sibling contract sees, those through a
package's `__init__` (`eldr.bus.bus` importing `eldr.bus`, which imports it back).
grimp reads every import statement, those inside functions and under TYPE_CHECKING too.
It also checks that the contracts name every top-level piece of `eldr`, so that a new wing
is not outside the layers (and free to import the core's way up) by being forgotten.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import grimp

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, imported = work[-1]
            step = next(imported, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.find_modules_directly_imported_by(step)))))
                elif step in on_stack:
                    low[module] = min(low[module], index[step])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_names_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(name)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p")
    graph.add_import(importer="p", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph) == [["p", "p.a", "p.b"]]


def test_no_import_cycles() -> None:
    graph = grimp.build_graph("eldr", "eldr_services", include_external_packages=False)
    cycles = _cycles(graph)
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def _contract(name: str) -> dict[str, Any]:
    config = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
    contracts = config["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["name"] == name)


def test_contracts_name_every_top_level_piece_of_eldr() -> None:
    graph = grimp.build_graph("eldr", include_external_packages=False)
    top = graph.find_children("eldr")
    core_forbids = set(_contract("the core imports no other project package")["forbidden_modules"])
    assert core_forbids == (top - {"eldr.core"}) | {"eldr_services"}
    layered = {
        name.strip()
        for layer in _contract("wings import downwards only")["layers"]
        for name in layer.split("|")
    }
    assert layered == top
