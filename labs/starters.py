"""Starters: the reference module with the lab's functions emptied, made from the reference itself.

What it is: `make_starter(lab, module, guidance)`, which parses the reference source, finds
each `Part` by its qualified name, keeps its signature and docstring (and, with `keep_until`,
the first lines of its body), and replaces the rest with the part's guiding comment at the
teacher's level of `guidance` (`spec.GUIDANCE`: the goal, the goal and a nudge, or the full
walk-through) and `raise NotImplementedError`. The banner says the level in one line,
`# guidance: short`, which `guidance_of` reads back, so that `check` hints no more than the
starter did (labs/grading.py). Every other line stays byte for byte, so a student's piece
runs inside the real engine. Imports that only the removed code used are kept and marked,
because the student's code will need them.

No starter is committed: `python -m labs start N DIR` makes lab N's from today's reference
when a student asks for it, and `python -m labs starters [DIR]` shows a teacher every lab's.
So a starter can never be a stale copy, and a grep of the repository finds each line once. A
change to a level that a lab's parts no longer fit (a renamed function, a `keep_until` line
gone) fails here, with the part's name, and tests/test_labs.py makes every lab's starter.

What it is not: a way to hide the solution. The reference is in the same repository;
the labs ask students not to open the module they are rewriting until they are done.

Reference: nbgrader's "### BEGIN SOLUTION / ### END SOLUTION" cells, done on the AST.
"""

from __future__ import annotations

import ast
import re

from .spec import DEFAULT_GUIDANCE, GUIDANCE, REPO, Lab, Module, Part

BANNER = (
    "# Lab {lab}: your copy of {path}.\n"
    "# Fill in every function that raises NotImplementedError (search for TODO), then run\n"
    "#     python -m labs check {lab} THIS_FILE\n"
    "# Made from the reference by `python -m labs start` (labs/starters.py); the rest is the reference, unchanged.\n"
    "# guidance: {guidance}  (how much each TODO says: none, short or full; `check` hints as much by default)\n"
)
GUIDANCE_LINE = re.compile(r"^# guidance: (\w+)(?:\s|$)", re.M)  # the banner's line, read back by guidance_of


def guidance_of(text: str) -> str | None:
    """The guidance level a starter's banner names (in its first lines), or None for a file without one."""
    head = "\n".join(text.splitlines()[:8])
    m = GUIDANCE_LINE.search(head)
    return m.group(1) if m and m.group(1) in GUIDANCE else None


def _find(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    scope: list[ast.stmt] = tree.body
    node = None
    for name in qualname.split("."):
        node = next(
            (
                n
                for n in scope
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == name
            ),
            None,
        )
        if node is None:
            raise ValueError(f"{qualname}: no {name!r} in the reference source")
        scope = node.body
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise ValueError(f"{qualname} is not a function")
    return node


def _replacement(lab: Lab, part: Part, indent: str, guidance: str) -> list[str]:
    out = [f"{indent}# TODO (lab {lab.id}): {part.qualname}\n"]
    for line in part.guidance(guidance).strip("\n").splitlines():
        out.append(f"{indent}# {line}".rstrip() + "\n")
    out.append(f'{indent}raise NotImplementedError("lab {lab.id}: write {part.qualname}")\n')
    return out


def starter_source(lab: Lab, module: Module, source: str, guidance: str = DEFAULT_GUIDANCE) -> str:
    if guidance not in GUIDANCE:
        raise ValueError(f"guidance {guidance!r}: choose one of {', '.join(GUIDANCE)}")
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    edits = []  # (first line index to replace, one past the last, new lines)
    for part in module.parts:
        fn = _find(tree, part.qualname)
        body = fn.body
        has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
        start = body[0].end_lineno if has_doc else body[0].lineno - 1  # 0-based index of the first line to drop
        indent = " " * body[0].col_offset
        if part.keep_until is not None:
            hits = [i for i in range(start, fn.end_lineno) if part.keep_until in lines[i]]
            if len(hits) != 1:
                raise ValueError(f"{part.qualname}: keep_until {part.keep_until!r} found {len(hits)} times")
            start = hits[0] + 1
            while start < fn.end_lineno and lines[start].strip() == "":
                start += 1
        edits.append((start, fn.end_lineno, _replacement(lab, part, indent, guidance)))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = new
    text = BANNER.format(lab=lab.id, path=module.reference_path.relative_to(REPO).as_posix(), guidance=guidance)
    if any(p.keep_until for p in module.parts):  # the kept prologue computes values only your code uses
        text += "# ruff: noqa: F841\n"
    return _mark_unused_imports(text + "".join(lines))


def _mark_unused_imports(source: str) -> str:
    """`# noqa: F401` on imports that only the removed code used: the student will need them."""
    tree = ast.parse(source)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    used |= {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)}
    for node in ast.walk(tree):  # names in string annotations count too (`from __future__ import annotations`)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            used |= {w for w in node.value.replace("[", " ").replace("]", " ").replace(",", " ").split()}
    lines = source.splitlines(keepends=True)
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and not (
            isinstance(node, ast.ImportFrom) and node.module == "__future__"
        ):
            names = [(a.asname or a.name).split(".")[0] for a in node.names]
            if any(n not in used for n in names) and "noqa" not in lines[node.lineno - 1]:
                i = node.lineno - 1
                lines[i] = lines[i].rstrip("\n") + "  # noqa: F401 (your code will need it)\n"
    return "".join(lines)


def make_starter(lab: Lab, module: Module, guidance: str = DEFAULT_GUIDANCE) -> str:
    return starter_source(lab, module, module.reference_path.read_text(), guidance)


def starter_files(lab: Lab, guidance: str = DEFAULT_GUIDANCE) -> dict[str, str]:
    """{file name: text} of every starter file of the lab, made now from today's reference."""
    return {m.filename: make_starter(lab, m, guidance) for m in lab.modules}
