"""kvray's import rules (docs/design.md, "Layers"), checked by reading every import statically.

Every ``import`` and ``from ... import`` of every module under kvray/ counts: at module
level, inside functions, under ``if TYPE_CHECKING:``, relative or absolute. A lazy import is
still a dependency (it runs the first time its function does) and a type-checking one still
couples the two modules, so layering and cycles count them all; only "what loads at import
time" (the core's torch and Ray rule) looks at the eager ones alone. Importing
``kvray.a.b`` also runs ``kvray/a/__init__.py``, but that implicit edge is not counted: a
package that re-exports its submodules would otherwise be a cycle with each of them.

Allowances for work in flight are named below (``CYCLES_BEING_REMOVED``,
``IMPORTS_BEING_REMOVED``) with the slice removing each; one that no longer applies fails
too, so it is deleted as soon as its import or cycle is gone.
"""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Layer -> the modules it holds (a package holds its submodules; the root package "kvray"
# holds only its own __init__, the core's public names).
LAYERS: dict[str, tuple[str, ...]] = {
    "base": ("kvray.lazy",),
    "core": ("kvray", "kvray.core"),
    "shared": ("kvray.resources", "kvray.progress", "kvray.traces", "kvray.report", "kvray.scenario"),
    "policy": ("kvray.policy",),
    "sim": ("kvray.sim",),
    "rl": ("kvray.rl",),
    "cluster": ("kvray.cluster",),
    "engines": ("kvray.engines",),
    "harness": ("kvray.harness",),
    "apps": ("kvray.apps",),
    "bench": ("kvray.bench",),
    "cli": ("kvray.cli", "kvray.flags", "kvray.__main__"),
}
# Layer -> the layers it may import besides itself; and, through them, what they may.
MAY_IMPORT: dict[str, tuple[str, ...]] = {
    "base": (),
    "core": ("base",),
    "shared": ("core",),
    "policy": ("shared",),
    "sim": ("policy",),
    "rl": ("sim",),
    "cluster": ("policy",),
    "engines": ("cluster",),
    "harness": ("engines",),
    "apps": ("rl", "harness"),
    "bench": ("rl", "harness"),
    "cli": ("apps", "bench"),
}
# Modules outside kvray/cluster that may import Ray: processes that start or join a Ray
# cluster themselves. Edit this list (and only this one) when an edge moves.
RAY_EDGES = frozenset(
    {
        "kvray.apps.replay",  # kvray run: connects, places the replay engines, runs the trace
        "kvray.apps.replay_engine",  # the replay's engine actor
        "kvray.apps.soak",  # the soak test: its own local Ray cluster, stores killed under it
        "kvray.apps.status",  # kvray status: asks the runtime's actors
        "kvray.bench.concurrency",  # benchmarks that drive a runtime
        "kvray.bench.long_context",
        "kvray.bench.runtime",
        "kvray.bench.serve",
        "kvray.bench.serve_cpu",  # CPU time of the serving actors
        "kvray.bench.serve_engines",
        "kvray.bench.serve_routers",  # Ray Serve's routers, in vLLM's environment
        "kvray.engines.runtime",  # an engine joining the Ray cluster of a named runtime
        "kvray.engines.vllm.serve",  # vLLM behind Ray Serve
        "kvray.engines.vllm.router",  # its request router, a Ray Serve RequestRouter
        "kvray.engines.vllm.verbs",  # the connector asks the controller for the cluster policy's verbs
        "kvray.harness.vllm_runs",  # the vLLM-on-Ray runs of the tests and benchmarks
    }
)
# Core modules that import torch when imported; the rest of the core imports them only
# inside the functions that need them (kvray.lazy).
TORCH_AT_IMPORT_IN_CORE = frozenset({"kvray.core.tiers.device"})
# Known breaks being removed by other slices of issue 33; the lead empties these after merging.
CYCLES_BEING_REMOVED: dict[frozenset[str], str] = {}
IMPORTS_BEING_REMOVED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a kvray module, or the top-level name of another package ("ray", "torch")
    line: int
    eager: bool  # runs when the importer is imported: not inside a function, not under TYPE_CHECKING


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


class _Imports(ast.NodeVisitor):
    """Every import of one module, resolved to the module it names."""

    def __init__(self, name: str, is_package: bool, known: set[str]) -> None:
        self.name, self.known = name, known
        self.package = name if is_package else name.rpartition(".")[0]
        self.found: list[Import] = []
        self._deferred = 0  # depth of function bodies and TYPE_CHECKING blocks around the node

    def _add(self, target: str, line: int) -> None:
        if target.split(".")[0] == "kvray":
            if target not in self.known:
                raise AssertionError(f"{self.name}:{line} imports {target}, which is not a module of kvray/")
        else:
            target = target.split(".")[0]
        self.found.append(Import(self.name, target, line, eager=self._deferred == 0))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            parts = self.package.split(".")
            up = parts[: len(parts) - (node.level - 1)]
            base = ".".join(up + ([node.module] if node.module else []))
        for alias in node.names:  # `from package import submodule` names the submodule
            full = f"{base}.{alias.name}"
            self._add(full if full in self.known else base, node.lineno)

    def _deferring(self, node: ast.AST) -> None:
        self._deferred += 1
        self.generic_visit(node)
        self._deferred -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = _deferring

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        ):
            self._deferred += 1
            for child in node.body:
                self.visit(child)
            self._deferred -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)


def scan(root: Path) -> tuple[set[str], list[Import]]:
    """The modules of the package at ``root`` (its C extensions too, which import nothing
    of kvray: ``from kvray.policy import _pool`` names the extension, not the package) and
    every import they make."""
    paths = {module_name(p, root.parent): p for p in sorted(root.rglob("*.py"))}
    known = set(paths) | {module_name(p, root.parent) for p in root.rglob("*.c")}
    found: list[Import] = []
    for name, path in paths.items():
        visitor = _Imports(name, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        found += visitor.found
    return known, found


@functools.cache
def kvray_imports() -> tuple[frozenset[str], tuple[Import, ...]]:
    known, found = scan(REPO / "kvray")
    return frozenset(known), tuple(found)


def layer_of(module: str) -> str | None:
    for layer, members in LAYERS.items():
        if any(module == m or (m != "kvray" and module.startswith(m + ".")) for m in members):
            return layer
    return None


def reachable(layer: str) -> set[str]:
    """``layer`` and every layer it may import, directly or through another."""
    seen, todo = set(), [layer]
    while todo:
        current = todo.pop()
        if current not in seen:
            seen.add(current)
            todo += MAY_IMPORT[current]
    return seen


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_walk_sees_every_kind_of_import(tmp_path):
    package = tmp_path / "kvray"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import mod\n")
    (package / "sub" / "mod.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import ray.util\n"
        "from ..low import x\n"
        "if TYPE_CHECKING:\n"
        "    import torch\n"
        "else:\n"
        "    import numpy\n"
        "class A:\n"
        "    from kvray.sub import mod\n"
        "def f():\n"
        "    from kvray import low\n"
    )
    _, found = scan(package)
    seen = {(i.importer, i.target, i.eager) for i in found}
    assert seen == {
        ("kvray.sub", "kvray.sub.mod", True),
        ("kvray.sub.mod", "typing", True),
        ("kvray.sub.mod", "ray", True),
        ("kvray.sub.mod", "kvray.low", True),
        ("kvray.sub.mod", "torch", False),
        ("kvray.sub.mod", "numpy", True),
        ("kvray.sub.mod", "kvray.sub.mod", True),
        ("kvray.sub.mod", "kvray.low", False),
    }
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "d"}}) == [frozenset("abc")]


def test_every_module_is_in_a_layer():
    known, _ = kvray_imports()
    assert set(MAY_IMPORT) == set(LAYERS)
    unplaced = sorted(m for m in known if layer_of(m) is None)
    assert not unplaced, f"add these modules to a layer in LAYERS (and docs/design.md, 'Layers'): {unplaced}"


def test_layers_import_only_what_they_build_on():
    _, found = kvray_imports()
    broken, allowed = [], set()
    for i in found:
        if i.target.startswith("kvray") and layer_of(i.target) not in reachable(layer_of(i.importer)):
            if (i.importer, i.target) in IMPORTS_BEING_REMOVED:
                allowed.add((i.importer, i.target))
            else:
                broken.append(f"{i.importer}:{i.line} ({layer_of(i.importer)}) imports {i.target} ({layer_of(i.target)})")
    assert not broken, "imports against the layers (docs/design.md, 'Layers'):\n" + "\n".join(broken)
    stale = set(IMPORTS_BEING_REMOVED) - allowed
    assert not stale, f"no longer imported: remove from IMPORTS_BEING_REMOVED: {sorted(stale)}"


def test_ray_is_imported_only_by_the_cluster_and_the_listed_edges():
    _, found = kvray_imports()
    importers = {i.importer for i in found if i.target == "ray"}
    outside = sorted(m for m in importers - RAY_EDGES if layer_of(m) != "cluster")
    assert not outside, f"import Ray through kvray.cluster, or name the module in RAY_EDGES: {outside}"
    stale = sorted(RAY_EDGES - importers)
    assert not stale, f"these import no Ray (any more): remove them from RAY_EDGES: {stale}"


def test_the_core_loads_neither_torch_nor_ray_when_imported():
    _, found = kvray_imports()
    core = [i for i in found if layer_of(i.importer) == "core"]
    heavy = sorted(
        f"{i.importer}:{i.line} imports {i.target}"
        for i in core
        if i.eager
        and i.importer not in TORCH_AT_IMPORT_IN_CORE
        and (i.target in ("torch", "ray") or i.target in TORCH_AT_IMPORT_IN_CORE)
    )
    assert not heavy, "import these inside the functions that need them (kvray.lazy):\n" + "\n".join(heavy)
    assert not [i for i in core if i.target == "ray"], "the core never imports Ray"
    torch_at_import = {i.importer for i in core if i.eager and i.target == "torch"}
    assert torch_at_import == TORCH_AT_IMPORT_IN_CORE


def test_no_import_cycles():
    _, found = kvray_imports()
    edges: dict[str, set[str]] = {}
    for i in found:
        if i.target.startswith("kvray") and i.target != i.importer:
            edges.setdefault(i.importer, set()).add(i.target)
    found_cycles = set(cycles(edges))
    unexpected = sorted(sorted(c) for c in found_cycles - set(CYCLES_BEING_REMOVED))
    assert not unexpected, f"import cycles: {unexpected}"
    gone = sorted(sorted(c) for c in set(CYCLES_BEING_REMOVED) - found_cycles)
    assert not gone, f"no longer a cycle (or a different one now): remove from CYCLES_BEING_REMOVED: {gone}"


def test_the_design_doc_states_these_layers():
    """docs/design.md's table under "Layers" is this module's LAYERS and MAY_IMPORT."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| *(\w+) *\|([^|]*)\|([^|]*)\|$", section, flags=re.M)
    stated = {
        layer: (tuple(re.findall(r"`([\w.]+)`", modules)), tuple(re.findall(r"\w+", may)))
        for layer, modules, may in rows
        if layer != "layer"
    }
    assert stated == {layer: (LAYERS[layer], MAY_IMPORT[layer]) for layer in LAYERS}
