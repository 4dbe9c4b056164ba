"""The package's import graph, read from the source with ``ast`` (nothing is imported).

Used by ``tests/test_layers.py``; also runnable to print the layers and any violation::

    .venv/bin/python tests/layering.py
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {  # package -> folder (pyproject's package-dir)
    "rrfp": "rrfp",
    "rrfp.traces": "traces",
    "rrfp.sim": "sim",
    "rrfp.exec": "exec",
}
LAYERS = (
    "rrfp.errors",
    "rrfp.validate",
    "rrfp.iofiles",
    "rrfp.plan",
    "rrfp.dispatch",
    "rrfp.workload",
    "rrfp.study",
    "rrfp.traces",
    "rrfp.sim",
    "rrfp.exec",
)
"""Each layer imports only the layers before it (and itself); docs/design.md says what each holds."""
FACADE = "rrfp"
"""``rrfp/__init__.py`` re-exports the public API: it sits above the core and no layer imports it."""
SIBLINGS = {("rrfp.exec", "rrfp.sim")}
"""Layers that are interpreters of the same core: the later one does not import the earlier one..."""
ALLOWED = {("rrfp.exec.cli", "rrfp.sim")}
"""...except by these (importing module, imported package) edges, and only lazily (inside a function):
rrfp-run's CLI may load the simulator for --dry-run estimates."""
EXEC_ROOMS = (
    ("rrfp.exec.config", "rrfp.exec.faults"),
    ("rrfp.exec.models",),
    ("rrfp.exec.comm",),
    ("rrfp.exec.loop",),
    ("rrfp.exec.pipelining",),
    ("rrfp.exec.integrations",),
    ("rrfp.exec.results", "rrfp.exec.report"),
    ("rrfp.exec.jobs",),
    ("rrfp.exec.preflight", "rrfp.exec.cli", "rrfp.exec.__main__", "rrfp.exec"),
)
"""The rooms of ``exec/`` in import order (docs/design.md §2): each imports only the rooms before it
(and itself). The package ``rrfp.exec`` itself belongs to the last room."""
PLAIN_ARGUMENTS = ("rrfp.exec.comm", "rrfp.exec.loop", "rrfp.exec.pipelining")
"""Rooms that take plain arguments -- never a RunConfig -- so a library API can build on them..."""
RUN_CONFIG_USERS: frozenset[str] = frozenset()
"""...with no exception: the CLI's trial runner and its torch baseline, which read the run's
configuration, live in ``exec/jobs/``."""
DISPATCH_DRIVERS = {"RankScheduler": "rrfp.dispatch.scheduler", "PipelineRuntime": "rrfp.exec.loop.runtime"}
"""The dispatch's own constructors (class -> its module): a rank's scheduler and its runtime loop..."""
DRIVEN_ROOMS = ("rrfp.exec.jobs",)
"""...which these rooms never name -- rrfp-run's trials dispatch through ``ScheduleReadiness``
(rrfp.exec.pipelining), the library being the one driver of rrfp's dispatch on real ranks. The
Megatron baseline's ``MegatronRuntime`` (rrfp.exec.loop.megatron, a separate program) is a different
name and so not held here."""


@dataclass(frozen=True)
class Edge:
    source: str  # importing module
    target: str  # imported rrfp module (or package)
    line: int
    lazy: bool  # inside a function (or under `if TYPE_CHECKING:`)


def modules() -> dict[str, Path]:
    """Every module of the distribution by dotted name (package ``__init__`` under the package name)."""
    out: dict[str, Path] = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if package == "rrfp" and parts and parts[0] in ("traces", "sim", "exec"):
                continue  # not a thing, but keep a stray folder from aliasing a mapped package
            name = ".".join([package, *parts])
            if package == "rrfp" and any(
                name.startswith(p + ".") or name == p for p in PACKAGE_DIRS if p != "rrfp"
            ):
                continue
            out[name] = path
    return out


def layer_of(module: str) -> int | None:
    """Index of the layer ``module`` belongs to; None for the facade (``rrfp`` itself)."""
    for i, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i
    return None


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module or package ``name`` refers to, or None if it is not ours."""
    while name and name not in known:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name or None


def edges(known: dict[str, Path] | None = None) -> list[Edge]:
    """Every import of one of our modules, at module level or inside functions."""
    known = modules() if known is None else known
    out: list[Edge] = []
    for source, path in known.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, lazy in _imports(tree):
            for target in _targets(node, source, is_package, known):
                if target != source:
                    out.append(Edge(source, target, node.lineno, lazy))
    return out


def _imports(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.append((child, lazy))
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, True)
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, True)
            else:
                visit(child, lazy)

    visit(tree, False)
    return found


def _targets(
    node: ast.Import | ast.ImportFrom, source: str, is_package: bool, known: dict[str, Path]
) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            base = source if is_package else source.rsplit(".", 1)[0]
            for _ in range(node.level - 1):
                base = base.rsplit(".", 1)[0]
            module = f"{base}.{node.module}" if node.module else base
        else:
            module = node.module or ""
        # `from pkg import sub` names the submodule when there is one.
        names = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
    return sorted({t for t in (_resolve(n, known) for n in names) if t is not None})


def violations(all_edges: list[Edge] | None = None) -> list[str]:
    """Edges against the layer order, imports of the facade from inside a layer, and imports between
    the interpreters other than the allowed lazy ones."""
    bad = []
    for e in edges() if all_edges is None else all_edges:
        src, dst = layer_of(e.source), layer_of(e.target)
        if src is None:
            continue  # the facade may import any layer
        if dst is None:
            bad.append(f"{e.source}:{e.line} imports the top-level package {e.target!r} (import the module)")
        elif dst > src:
            where = f"{e.source}:{e.line} ({LAYERS[src]})"
            bad.append(f"{where} imports {e.target} ({LAYERS[dst]}): a later layer")
        elif (LAYERS[src], LAYERS[dst]) in SIBLINGS and not (_allowed(e) and e.lazy):
            bad.append(f"{e.source}:{e.line} imports {e.target}: the interpreters stay apart")
    return bad


def room_of(module: str) -> int | None:
    """Index of the exec room ``module`` belongs to; None outside ``rrfp.exec``."""
    best: tuple[int, int] | None = None
    for i, room in enumerate(EXEC_ROOMS):
        for prefix in room:
            if module == prefix or (prefix != "rrfp.exec" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    return None if best is None else best[0]


def room_violations(all_edges: list[Edge] | None = None) -> list[str]:
    """Edges inside ``rrfp.exec`` against the room order, and imports of the run configuration from a
    room that takes plain arguments."""
    bad = []
    for e in edges() if all_edges is None else all_edges:
        src, dst = room_of(e.source), room_of(e.target)
        if src is None or dst is None:
            continue
        if dst > src:
            bad.append(f"{e.source}:{e.line} imports {e.target}: a later room of exec/")
        plain = any(e.source.startswith(p + ".") for p in PLAIN_ARGUMENTS)
        if plain and e.target == "rrfp.exec.config" and e.source not in RUN_CONFIG_USERS:
            bad.append(f"{e.source}:{e.line} imports rrfp.exec.config: this room takes plain arguments")
    return bad


@dataclass(frozen=True)
class NameUse:
    module: str
    name: str  # a DISPATCH_DRIVERS class, as written (import, call, attribute or base class)
    line: int


def driver_uses(known: dict[str, Path] | None = None) -> list[NameUse]:
    """Every mention of a DISPATCH_DRIVERS class in a module of DRIVEN_ROOMS: imported (under any
    alias), called, read as an attribute (``scheduler.RankScheduler``) or subclassed."""
    known = modules() if known is None else known
    out: list[NameUse] = []
    for module, path in known.items():
        if any(module == r or module.startswith(r + ".") for r in DRIVEN_ROOMS):
            out += _names_in(module, ast.parse(path.read_text(), filename=str(path)))
    return out


def _names_in(module: str, tree: ast.AST) -> list[NameUse]:
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        found += [NameUse(module, n, node.lineno) for n in names if n in DISPATCH_DRIVERS]  # type: ignore[attr-defined]
    return found


def driver_violations(uses: list[NameUse] | None = None) -> list[str]:
    """Modules of DRIVEN_ROOMS that build the dispatch themselves instead of through ScheduleReadiness."""
    return [
        f"{u.module}:{u.line} names {u.name} ({DISPATCH_DRIVERS[u.name]}): build it through ScheduleReadiness"
        for u in (driver_uses() if uses is None else uses)
    ]


def _allowed(e: Edge) -> bool:
    return any(e.source == s and (e.target == t or e.target.startswith(t + ".")) for s, t in ALLOWED)


def cycles(all_edges: list[Edge] | None = None) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), lazy imports included."""
    graph: dict[str, set[str]] = {}
    for e in edges() if all_edges is None else all_edges:
        graph.setdefault(e.source, set()).add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


if __name__ == "__main__":
    found = edges()
    for layer in LAYERS:
        names = sorted(m for m in modules() if layer_of(m) == LAYERS.index(layer))
        print(f"{layer}: {len(names)} modules")
    print("violations:", *violations(found) or ["none"], sep="\n  ")
    print("exec rooms:", *room_violations(found) or ["none"], sep="\n  ")
    print("dispatch drivers:", *driver_violations() or ["none"], sep="\n  ")
    print("cycles:", *[" <-> ".join(c) for c in cycles(found)] or ["none"], sep="\n  ")


RUNNERS = {
    ("rrfp.exec.pipelining.compute", "StageCompute"),  # every model's tasks: the library's and rrfp-run's
    ("rrfp.exec.models.synthetic", "SyntheticRunner"),  # rrfp-run --synthetic: sleeps, no model
}
"""The classes allowed to implement the runtime loop's Runner protocol (one engine)."""


def runner_classes(known: dict[str, Path] | None = None) -> list[tuple[str, str]]:
    """(module, class) of every class in the package with the Runner protocol's methods (``run``,
    ``finish``, ``held_tasks``), the protocol aside: a compute side the runtime loop could drive."""
    known = modules() if known is None else known
    out = []
    for module, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ClassDef) or "Protocol" in _base_names(node):
                continue  # the Runner protocol itself is no engine
            methods = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            if {"run", "finish", "held_tasks"} <= methods:
                out.append((module, node.name))
    return out


def _base_names(node: ast.ClassDef) -> list[str]:
    return [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]


def runner_violations(found: list[tuple[str, str]] | None = None) -> list[str]:
    """Compute sides besides the library's StageCompute (and --synthetic's sleeper)."""
    return [
        f"{m}.{c}: a second compute engine (models run through rrfp.exec.pipelining.compute.StageCompute)"
        for m, c in (runner_classes() if found is None else found)
        if (m, c) not in RUNNERS
    ]
