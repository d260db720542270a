"""The import graph of `hybridgate/`: no cycle, and the settings, the gateway and the router reach no worker.

The graph is read from the source with `ast` (module-level imports only: an
import inside a function runs when it is called, so it is the lazy kind that
keeps a command cheap). A package that loads its names lazily (PEP 562
`__getattr__`, e.g. `hybridgate.router`) declares them under
`if TYPE_CHECKING:`; `from hybridgate.router import Router` is read as an
import of the module declared there. Importing `a.b.c` loads the packages `a`
and `a.b` first, so reaching a module reaches its parents. The subprocess tests check the same from
`sys.modules`, as a user's command runs. A type checker reads the imports under `if TYPE_CHECKING:` too:
`TYPED` is the graph it sees, which has no cycle either.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hybridgate"
WORKERS = "hybridgate.workers"
# The workers' settings live in their package (data only; the package's __init__ imports nothing), so the
# settings root loads these two and no worker behaviour.
WORKER_SETTINGS = ("hybridgate.workers", "hybridgate.workers.config")
NO_WORKERS = ("hybridgate.gateway", "hybridgate.router", "hybridgate.settings", "hybridgate.config",
              "hybridgate.run.config", "hybridgate.workers.config")


def worker_behaviour(modules) -> list[str]:
    """The modules of `hybridgate.workers` among `modules`, its settings left out."""
    return sorted(m for m in modules if m.startswith(WORKERS) and m not in WORKER_SETTINGS)


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _lazy_names(path: Path) -> dict[str, str]:
    """A package's names declared under `if TYPE_CHECKING:` (loaded by its `__getattr__`) → their modules."""
    out = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for imp in node.body:
                if isinstance(imp, ast.ImportFrom) and imp.module:
                    out.update({alias.asname or alias.name: imp.module for alias in imp.names})
    return out


def _imports(name: str, path: Path, lazy_too: bool = False, typing_too: bool = False) -> set[str]:
    """The hybridgate modules `name` imports at module level (`lazy_too`: in its functions as well;
    `typing_too`: under `if TYPE_CHECKING:` as well)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if lazy_too and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With,
                                              ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)):
                visit(node.body + getattr(node, "orelse", []))
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
                    full = f"{base}.{alias.name}"
                    found.add(full if full in MODULES else LAZY.get(base, {}).get(alias.name, base))
            elif isinstance(node, ast.If):
                if typing_too or not _is_type_checking(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body])

    visit(ast.parse(path.read_text(encoding="utf-8")).body)
    return {m for m in found if m in MODULES and m != name}


LAZY = {name: _lazy_names(path) for name, path in MODULES.items() if path.name == "__init__.py"}
GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}
EVERY_IMPORT = {name: _imports(name, path, lazy_too=True) for name, path in MODULES.items()}
TYPED = {name: _imports(name, path, lazy_too=True, typing_too=True) for name, path in MODULES.items()}


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


def reached(start: str, graph: dict[str, set[str]] = GRAPH) -> set[str]:
    """Every module loaded by importing `start`: its imports, their parents, transitively (in `graph`)."""
    seen, todo = set(), [start, *_parents(start)]
    while todo:
        for m in graph[todo.pop()]:
            for x in (m, *_parents(m)):
                if x not in seen:
                    seen.add(x)
                    todo.append(x)
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_graph_is_read_right():
    """The reader itself, on edges known by hand: `from module import name`, `from pkg import mod`,
    a lazy package's name, and a function's import left out."""
    assert "hybridgate.workers.engine" in GRAPH["hybridgate.workers.process"]
    assert "hybridgate.router.costmodel" in GRAPH["hybridgate.router.policy"]  # from hybridgate.router import costmodel
    assert "hybridgate.router.router" in GRAPH["hybridgate.run.serve"]  # from hybridgate.router import Router
    assert GRAPH["hybridgate.router"] == set()  # its names load on first use
    assert "hybridgate.workers.process" not in GRAPH["hybridgate.cli"]  # imported inside _cmd_worker
    assert "hybridgate.workers.process" in EVERY_IMPORT["hybridgate.cli"]
    assert "hybridgate.workers" in reached("hybridgate.workers.engine")  # a module's package loads first
    assert "hybridgate.models.gguf_file" in TYPED["hybridgate.bench.shapes"]  # under TYPE_CHECKING
    assert "hybridgate.models.gguf_file" not in GRAPH["hybridgate.bench.shapes"]


def test_no_import_cycle_in_the_package():
    """None at module level, and none through a function's import either (config.py's lazy import of
    the settings root closed a 33-module cycle that way)."""
    assert cycles(GRAPH) == []
    assert cycles(EVERY_IMPORT) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_even_for_type_checkers():
    """The graph a type checker reads (`if TYPE_CHECKING:` imports included) has no cycle: the router's
    modules that only call a `Router` name a small Protocol of what they call instead of importing it."""
    assert cycles(TYPED) == []


@pytest.mark.parametrize("start", sorted(m for m in MODULES if m.startswith(WORKERS + ".")))
def test_no_worker_module_imports_the_gateway_or_the_router(start):
    """A worker is below both doors: what it shares with the router (the worker-client interface and
    lifecycle, the vLLM metric names) lives below both, never in `hybridgate.gateway` or `hybridgate.router`;
    not even through another module, a function's import or a type checker's."""
    doors = ("hybridgate.gateway", "hybridgate.router")
    assert sorted(m for m in TYPED[start] if m.startswith(doors)) == []
    assert sorted(m for m in reached(start, TYPED) if m.startswith(doors)) == []


@pytest.mark.parametrize("start", sorted(m for m in MODULES if m.startswith(NO_WORKERS)))
def test_settings_gateway_and_router_reach_no_worker_module(start):
    assert worker_behaviour(reached(start)) == []


def test_the_workers_package_imports_nothing():
    """So that importing `hybridgate.workers.config` (the settings root does) loads nothing else."""
    assert EVERY_IMPORT[WORKERS] == set() and TYPED[WORKERS] == set()


def test_the_settings_machinery_imports_no_part():
    """config.py takes the root as an argument: not even a lazy import of hybridgate."""
    tree = ast.parse((PACKAGE / "config.py").read_text(encoding="utf-8"))
    named = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    named += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert [m for m in named if m and m.startswith("hybridgate")] == []


def test_the_settings_root_imports_no_behaviour():
    """Reading the settings loads the parts' config modules and what their checks need, nothing else."""
    assert reached("hybridgate.settings") <= {
        "hybridgate", "hybridgate.config", "hybridgate.gateway", "hybridgate.gateway.auth",
        "hybridgate.gateway.config", "hybridgate.security", "hybridgate.security.keys", "hybridgate.security.redisconf",
        "hybridgate.router", "hybridgate.router.config", "hybridgate.run", "hybridgate.run.config",
        "hybridgate.workers", "hybridgate.workers.config"}


def _loaded(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(sorted(sys.modules))"],
                         capture_output=True, text=True, timeout=120, check=True)
    return [m for m in eval(out.stdout.splitlines()[-1]) if m.startswith("hybridgate")]  # a list of str literals


@pytest.mark.parametrize("code", ["import hybridgate.gateway.server",
                                  "from hybridgate.settings import Settings; Settings()"])
def test_a_gateway_import_loads_no_worker_module(code):
    loaded = _loaded(code)
    assert any(m.startswith(code.split()[1]) for m in loaded)  # the import itself was seen
    assert worker_behaviour(loaded) == []


def test_generate_help_loads_no_worker_module():
    """`python -X importtime -m hybridgate generate --help`, as the issue measures it: importtime's
    lines name every module the command loaded."""
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "hybridgate", "generate", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")]
    assert "hybridgate.settings" in loaded and "hybridgate.cli" in loaded
    assert worker_behaviour(loaded) == []
