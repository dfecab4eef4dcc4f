"""The package's import structure: no import cycle between pyzero's modules, and no module
reaching into another package's private (underscore) names.

Imports are read from the source (module level and inside functions alike: a lazy import
is still a dependency), so this checks the code as written, not what one run happens to load.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "pyzero"
EXTENSIONS = {"pyzero._C"}  # compiled modules: import nothing of pyzero, their names are public


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def package_of(name: str, mods: dict[str, Path]) -> str:
    """The package a module belongs to (a package's __init__ belongs to the package itself)."""
    return name if mods[name].name == "__init__.py" else name.rpartition(".")[0]


def resolve(importer: str, mods: dict[str, Path], level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    base = package_of(importer, mods).split(".")
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports(name: str, mods: dict[str, Path]):
    """(target module, imported names or None, the ast node) for every import in module `name`."""
    tree = ast.parse(mods[name].read_text(), str(mods[name]))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None, a.asname or a.name.split(".")[0], node
        elif isinstance(node, ast.ImportFrom):
            target = resolve(name, mods, node.level, node.module)
            for a in node.names:
                yield target, a.name, a.asname or a.name, node


def edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m in mods:
        for target, name, _, _ in imports(m, mods):
            if name is not None and f"{target}.{name}" in EXTENSIONS:
                continue
            if name is not None and f"{target}.{name}" in mods:
                target = f"{target}.{name}"  # `from pkg import submodule`
            if target in mods and target != m:
                graph[m].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def private_uses(mods: dict[str, Path]) -> list[str]:
    """`from X import _y` or `X._y` where X is a pyzero module of another package."""
    found = []
    for m, path in mods.items():
        aliases: dict[str, str] = {}  # local name -> pyzero module it is bound to
        for target, name, local, node in imports(m, mods):
            full = f"{target}.{name}" if name is not None else target
            if full in EXTENSIONS:
                continue
            if full in mods:
                aliases[local] = full
            elif name is not None and name.startswith("_") and not name.startswith("__") and target in mods \
                    and package_of(target, mods) != package_of(m, mods):
                found.append(f"{m}:{node.lineno}: from {target} import {name}")
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                target = aliases[node.value.id]
                attr = node.attr
                if attr.startswith("_") and not attr.startswith("__") and target != m \
                        and package_of(target, mods) != package_of(m, mods) and f"{target}.{attr}" not in mods:
                    found.append(f"{m}:{node.lineno}: {node.value.id}.{attr} ({target})")
    return found


def test_the_checker_sees_cycles_and_private_uses():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    mods = modules()
    assert "pyzero.comm" in mods and "pyzero.backend" in mods and "pyzero.zero" in mods
    graph = edges(mods)
    assert "pyzero.backend" in graph["pyzero.comm"]  # relative imports resolve
    assert "pyzero.comm" in graph["pyzero.symmetric"]  # `from . import comm` is an edge to the module


def test_no_import_cycle():
    cycle = find_cycle(edges(modules()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_backend_interface_imports_no_backend():
    graph = edges(modules())
    # import nothing of pyzero: the settings parser and the argument predicates every layer shares
    leaves = {"pyzero.envvars", "pyzero.checks"}
    for leaf in leaves:
        assert not {t for t in graph[leaf] if t.startswith("pyzero.")}, graph[leaf]
    assert not {t for t in graph["pyzero.backend"] if t.startswith("pyzero.") and t not in leaves}, \
        graph["pyzero.backend"]
    for m in ("pyzero.backends.shm", "pyzero.backends.nccl"):
        assert "pyzero.comm" not in graph[m], f"{m} imports pyzero.comm: backends sit under it"


def test_no_private_names_across_packages():
    uses = private_uses(modules())
    assert not uses, "private names used across packages:\n" + "\n".join(uses)
