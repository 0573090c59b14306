"""The package's import graph has no cycle (a registry imported by what it registers is one)."""

from __future__ import annotations

import ast
from pathlib import Path

import cuflash

PACKAGE = Path(cuflash.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every cuflash module imported anywhere in the file (module level or inside functions)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # Importing a module first imports its parent packages, which are then already initializing: an
            # import of an ancestor package ("from . import sim" in cuflash.api) is not an edge back to it.
            if not name.startswith(module + "."):
                found.add(module)
            found |= {f"{module}.{alias.name}" for alias in node.names}  # "from . import sim" imports a module
    return {m for m in found if m == "cuflash" or m.startswith("cuflash.")}


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "cuflash.kernels.catalog" in graph["cuflash.kernels.plans"]  # plans import the catalog ...
    assert "cuflash.kernels.plans" not in graph["cuflash.kernels.catalog"]  # ... never the reverse
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = import_graph()
    graph["cuflash.kernels.program"] = graph["cuflash.kernels.program"] | {"cuflash.kernels.plans"}
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and "cuflash.kernels.program" in cycle


def test_only_public_jax_apis():
    """[jax-scale] 4: nothing in cuflash reaches into jax._src (private, changes between releases)."""
    package = Path(__file__).resolve().parents[1] / "cuflash"
    found = [f"{path.relative_to(package)}:{number}" for path in sorted(package.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if "jax._src" in line.split("#")[0] or "from jax._src" in line]
    assert not found, found


def test_the_minimum_jax_is_the_one_tested():
    """[jax-scale] 4: setup.cfg asks for the JAX the suite runs with here (0.10.2). Older ones fail: 0.7.0's
    custom_partitioning takes no factor sizes or replication hints, and with 0.8.0 the shard_map and ring workers
    and jax.nn's local_window_size comparisons fail."""
    import configparser

    import jax

    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    for extra in ("jax", "test"):
        assert "jax>=0.10.2" in config["options.extras_require"][extra].split()
    import re

    assert tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:3]) >= (0, 10, 2)
