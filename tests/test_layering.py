"""The house's layout, read from the code: no import circle, and levels reach rooms only through the registry.

What it is: every `import` and `from ... import` of the project's packages (the levels,
`features/`, `ladder/`, `benchmarks/`, `labs/`), at any depth of a file (inside functions too,
where a lazy import still ties two files), read with `ast`, as a graph of files:

  - it has no cycle (issue 48: "no import circles anywhere in the project");
  - no level file imports a room (`features.*`): a level asks `ladder/rooms.py` by a setting;
  - `ladder/` imports no level and no room (it names the rooms only as strings);
  - a level imports no higher level.

What it is not: a check of what is imported by string (`importlib.import_module`, the
registry's own table: that is the point of it), or of the tests' imports.
"""

from __future__ import annotations

import ast
from pathlib import Path

from ladder.models import REPO

PACKAGES = ["ladder", "level0_naive", "level1_paged", "level2_continuous", "level3_prefix", "level4_speculative",
            "level5_multigpu", "level6_serving", "features", "benchmarks", "labs"]  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def files() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py") if "__pycache__" not in p.parts}


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (a `from package import name` that names a submodule counts as it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import a.b.c` of a package: the deepest project module named
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    known = files()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_no_import_circle():
    g = graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(g[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt] if nxt in path else [node, nxt]
                raise AssertionError("an import circle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert len(g) > 150, "the walk found too few modules to mean anything"


def level_of(module: str) -> int | None:
    top = module.split(".")[0]
    return int(top[5]) if top.startswith("level") else None


def test_levels_reach_rooms_only_through_the_registry_and_never_a_higher_level():
    found = []
    for name, targets in graph().items():
        lvl, top = level_of(name), name.split(".")[0]
        for t in targets:
            t_lvl, t_top = level_of(t), t.split(".")[0]
            if lvl is not None and t_top == "features":
                found.append(f"{name} imports the room {t}")
            if lvl is not None and t_lvl is not None and t_lvl > lvl:
                found.append(f"{name} (level {lvl}) imports {t} (level {t_lvl})")
            if top == "ladder" and (t_lvl is not None or t_top == "features"):
                found.append(f"{name} (ladder) imports {t}")
    assert not found, "\n".join(found)
    assert "ladder.rooms" in graph()["level0_naive.core"], "level 0 asks the registry for its rooms"
