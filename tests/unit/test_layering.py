"""The package's layering rule, and no import cycle between its modules.

Every ``import`` and ``from ... import`` statement of every module of `speccycle` is read with `ast`: at module
level and inside functions and methods alike (a deferred import is still a dependency, and the place import
cycles hide), relative imports resolved against the module's package. ``from pkg import name`` is an edge to
the submodule ``pkg.name`` when there is one, else to ``pkg`` itself. Dynamic imports (the backend registry's
``__import__`` of its own backends) are not statements and are not read.

**Layers** (the repository's top-level folders; ``cli`` is ``cli.py``). A module may import modules of its own
layer and of the layers its row lists, nothing else of the package:

=============  ==========================================================================================
layer          may import
=============  ==========================================================================================
core           (nothing of the package: records, ports, config, shapes, tree arithmetic)
backends       core (ops on tensors; never the engine)
statemachine   core, backends (the ops, through the registry, and the torch backend's sampling helpers)
engine         core, backends, statemachine
integrations   core, backends, statemachine, engine (adapters of the ports over other frameworks' models)
testing        core, backends, statemachine, engine (test doubles; a worker over the engine's TP model)
train          core, backends, statemachine, engine; and ``bench.common`` alone (`ALSO_ALLOWED`)
bench          core, backends, statemachine, engine, testing, train, integrations
cli            core, backends, statemachine, engine, testing, train, bench, integrations
=============  ==========================================================================================

The package's own ``__init__`` imports nothing and no module imports it by name. ``train`` reaching
``bench.common``: the training pipeline's ``eval`` stage writes its benchmark record with the header every
benchmark writes (`bench.common.write_result`; skipped when the bench folder is not installed).

**Cycles**: the module graph (package modules only, every edge above) has none; a failure prints each
cycle found with the file and line of every import on it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import speccycle

PACKAGE = "speccycle"
ROOT = Path(speccycle.__file__).resolve().parent

MAY_IMPORT: dict[str, frozenset[str]] = {
    "core": frozenset(),
    "backends": frozenset({"core"}),
    "statemachine": frozenset({"core", "backends"}),
    "engine": frozenset({"core", "backends", "statemachine"}),
    "integrations": frozenset({"core", "backends", "statemachine", "engine"}),
    "testing": frozenset({"core", "backends", "statemachine", "engine"}),
    "train": frozenset({"core", "backends", "statemachine", "engine"}),
    "bench": frozenset({"core", "backends", "statemachine", "engine", "testing", "train", "integrations"}),
    "cli": frozenset({"core", "backends", "statemachine", "engine", "testing", "train", "bench", "integrations"}),
    PACKAGE: frozenset(),
}
# (importing layer, imported module): single modules a layer may reach outside its row
ALSO_ALLOWED = {("train", "speccycle.bench.common")}


def package_modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package's __init__)}`` for the package's ``__init__``, its top-level modules
    and every module of its subpackages (folders with an ``__init__.py``, nested ones too). A file whose path
    has a part that is no identifier (a hidden folder, a copy of the tree under one) or that lies under a
    folder without an ``__init__.py`` cannot be imported as a module of the package and is not one."""
    modules = {PACKAGE: (root / "__init__.py", True)}
    for path in sorted(root.glob("*.py")):
        if path.name != "__init__.py" and path.stem.isidentifier():
            modules[f"{PACKAGE}.{path.stem}"] = (path, False)
    for init in sorted(root.glob("*/__init__.py")):
        for path in sorted(init.parent.rglob("*.py")):
            rel = path.relative_to(root)
            if not all(part.isidentifier() for part in rel.with_suffix("").parts):
                continue
            if not all((root / Path(*rel.parts[:i]) / "__init__.py").is_file() for i in range(1, len(rel.parts))):
                continue
            parts = rel.with_suffix("").parts
            is_init = parts[-1] == "__init__"
            modules[".".join((PACKAGE, *(parts[:-1] if is_init else parts)))] = (path, is_init)
    return modules


def imports_of(name: str, path: Path, is_init: bool, modules) -> list[tuple[str, int]]:
    """``(imported package module, line)`` for every import statement of the module, at any depth."""
    package = name if is_init else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((sub if sub in modules else source, node.lineno))
    return [(target, line) for target, line in found if target == PACKAGE or target.startswith(PACKAGE + ".")]


def import_graph(modules) -> dict[str, list[tuple[str, int]]]:
    return {name: imports_of(name, path, is_init, modules) for name, (path, is_init) in modules.items()}


def layer_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def layer_violations(graph, modules) -> list[str]:
    """Every import that breaks `MAY_IMPORT`, or names no module of the package, as ``file:line: a -> b``."""
    bad = []
    for source, targets in sorted(graph.items()):
        where = modules[source][0].relative_to(ROOT)
        own = layer_of(source)
        for target, line in targets:
            if target not in modules:
                bad.append(f"{where}:{line}: {source} imports {target}, which is no module of the package")
                continue
            theirs = layer_of(target)
            if theirs == own or theirs in MAY_IMPORT[own] or (own, target) in ALSO_ALLOWED:
                continue
            bad.append(f"{where}:{line}: {source} ({own}) imports {target} ({theirs}); {own} may import "
                       f"{', '.join(sorted(MAY_IMPORT[own])) or 'nothing of the package'}")  # fmt: skip
    return bad


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per strongly connected component of more than one module (or a module
    importing itself), components found by Tarjan's algorithm, the cycle by a breadth-first search inside."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        start = min(component)
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parent:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in component and w not in parent:
                        parent[w] = v
                        nxt.append(w)
            frontier = nxt
        path, v = [start], parent[start]
        while v != start:
            path.append(v)
            v = parent[v]
        cycles.append([start, *reversed(path[1:]), start])
    return cycles


def describe(cycle: list[str], graph, modules) -> str:
    hops = []
    for a, b in zip(cycle, cycle[1:]):
        lines = sorted(line for target, line in graph[a] if target == b)
        hops.append(f"  {a} -> {b}  ({modules[a][0].relative_to(ROOT)}:{', '.join(map(str, lines))})")
    return "\n".join([" -> ".join(cycle), *hops])


MODULES = package_modules()
GRAPH = import_graph(MODULES)


def test_the_walk_sees_every_layer_and_deferred_imports():
    """The walk reads what it must: every layer's modules, module-level, relative and function-level imports."""
    assert {layer_of(m) for m in MODULES} == set(MAY_IMPORT), "a top-level folder is missing from MAY_IMPORT"
    assert len(MODULES) > 100 and "speccycle.engine.drafters.eagle" in MODULES
    edges = {(a, b) for a, targets in GRAPH.items() for b, _ in targets}
    assert ("speccycle.backends.registry", "speccycle.backends.torch") in edges  # `from .torch import ...`
    assert ("speccycle.engine.fast.path", "speccycle.engine.fast.fused_cycle") in edges  # module level
    assert ("speccycle.cli", "speccycle.engine.engine") in edges  # inside `_load_engine`
    assert ("speccycle.engine.cli_options", "speccycle.engine.engine") in edges  # inside `spec_from_args`


def test_layers_import_only_the_layers_below():
    bad = layer_violations(GRAPH, MODULES)
    assert not bad, "imports against the layering (tests/unit/test_layering.py's table):\n" + "\n".join(bad)


def test_no_import_cycle_between_modules():
    graph = {name: {target for target, _ in targets if target in MODULES} for name, targets in GRAPH.items()}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (move the shared definitions, do not defer an import):\n" + "\n".join(
        describe(c, GRAPH, MODULES) for c in cycles
    )


def test_the_checks_catch_what_they_look_for():
    """A cycle (also one through a module importing itself) and an upward import are reported."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"a"}}) == [["a", "a"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    fake = {"speccycle.backends.cuda.ops": [("speccycle.engine.fast.path", 3), ("speccycle.core.tree", 4)]}
    modules = {
        "speccycle.backends.cuda.ops": (ROOT / "backends" / "cuda" / "ops.py", False),
        "speccycle.engine.fast.path": (ROOT / "engine" / "fast" / "path.py", False),
        "speccycle.core.tree": (ROOT / "core" / "tree.py", False),
    }
    bad = layer_violations(fake, modules)
    assert len(bad) == 1 and "backends/cuda/ops.py:3" in bad[0] and "speccycle.engine.fast.path (engine)" in bad[0]
