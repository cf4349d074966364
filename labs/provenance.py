"""Is the hand-in the student's own? A copy of the reference, or a use of it, found on the AST.

What it is: two static looks at a student's files, taken by `python -m labs check` before
anything runs (`labs/grading.py`).

  - `copied_parts(lab, swaps)`: the lab's functions (its `Part`s) whose bodies are the
    reference's once both are `normalised`: docstrings and string statements dropped,
    annotations dropped, every name (variables, arguments, nested functions, globals)
    renamed in the order it first appears. Comments and whitespace are not in the AST. So
    the reference with its variables renamed and its comments rewritten is caught; a
    body of a handful of nodes (`return p`) never counts, nor a reference with the part
    emptied (a student edition's, `labs/student_edition.py`). `check` flags the hand-in
    `copied-reference` when more than half of the parts that can tell are copies
    (`is_a_copy`: one short function can match by chance) and still scores it: the teacher
    decides.
  - `uses_of_the_reference(lab, swaps)`: why a file is refused, or None. A file that gets
    the reference's code instead of being it: an import of the module it replaces (by name,
    relative or absolute, `from pkg import module`, `importlib.import_module`/`__import__`
    of the name), a string that is its name or names its file (`"level4_speculative.rejection_sampler"`,
    `".../level4_speculative/rejection_sampler.py"`, `"rejection_sampler.py"`: what `open`, `exec`, `runpy`,
    `spec_from_file_location`, `sys.modules[...]` or `git show` need), a module's
    `__file__`/`__path__`/`__spec__`/`__loader__` (a path into the engine's source), and
    `inspect`'s source getters. Docstrings are not looked at.

What it cannot catch (it reads the file, it does not run it): a name or a path built at
run time (`"rejection_" + "sampler"`, `chr`, base64, a file listing), the source read from
anywhere but the reference's path (a copy kept elsewhere, pip's installed copy, the
network), a copy edited beyond renaming (a statement moved, an expression rewritten: the
normalised bodies differ), and two students' files alike (identical files only: `grade`'s
`same-files-as`; MOSS or JPlag compare structure). Nor is it a sandbox: a refused file
never runs, but an accepted one runs with the student's rights (`labs/runner.py`).

Reference: the AST comparison of MOSS-like tools, reduced to exact equality after
renaming; Python's `ast` module.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path

from .spec import Lab
from .starters import _find

MIN_NODES = 12  # a body smaller than this (`return p`, one call) says nothing about where it came from
SOURCE_ATTRIBUTES = {"__file__", "__path__", "__spec__", "__loader__", "__cached__"}
SOURCE_GETTERS = {"getsource", "getsourcefile", "getsourcelines", "getfile", "findsource"}  # inspect's


class _Canonical(ast.NodeTransformer):
    """Every name renamed `n0`, `n1`, ... in the order it first appears; annotations and strings-as-statements
    (docstrings) gone."""

    def __init__(self):
        self.names: dict[str, str] = {}

    def name(self, old: str) -> str:
        return self.names.setdefault(old, f"n{len(self.names)}")

    def visit_Name(self, node):
        node.id = self.name(node.id)
        return node

    def visit_arg(self, node):
        node.arg, node.annotation, node.type_comment = self.name(node.arg), None, None
        return node

    def _named(self, node):
        node.name = self.name(node.name)
        if hasattr(node, "returns"):
            node.returns = None
        node.body = [s for s in node.body if not _is_string_statement(s)] or [ast.Pass()]
        return self.generic_visit(node)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _named

    def visit_AnnAssign(self, node):  # `x: int = 1` is `x = 1`
        if node.value is None:
            return None
        return self.visit(ast.Assign(targets=[node.target], value=node.value))

    def visit_ExceptHandler(self, node):
        if node.name:
            node.name = self.name(node.name)
        return self.generic_visit(node)

    def visit_Global(self, node):
        node.names = [self.name(n) for n in node.names]
        return node

    visit_Nonlocal = visit_Global

    def generic_visit(self, node):
        for field in ("body", "orelse", "finalbody"):  # string statements anywhere: comments written as strings
            block = getattr(node, field, None)
            if isinstance(block, list) and block and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                              ast.ClassDef)):  # fmt: skip
                setattr(node, field, [s for s in block if not _is_string_statement(s)] or [ast.Pass()])
        return super().generic_visit(node)


def _is_string_statement(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def normalised(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The function's body with names made canonical (its arguments named first, in order), as one string
    to compare: equal strings, the same code up to names, docstrings, annotations, comments and layout."""
    canonical = _Canonical().visit(copy.deepcopy(fn))
    return "\n".join(ast.dump(s, include_attributes=False) for s in canonical.body)


def size(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The number of AST nodes in the body, docstring left out."""
    body = [s for s in fn.body if not _is_string_statement(s)]
    return sum(1 for s in body for _ in ast.walk(s))


def copied_parts(lab: Lab, swaps: dict[str, str]) -> list[str]:
    """The qualnames of the lab's parts whose bodies equal the reference's, normalised (big enough to tell)."""
    copied = []
    for m in lab.modules:
        if Path(swaps[m.name]).resolve() == m.reference_path.resolve():  # a student edition, checked in place
            continue
        mine, ref = ast.parse(Path(swaps[m.name]).read_text()), ast.parse(m.reference_path.read_text())
        for part in m.parts:
            try:
                fn = _find(mine, part.qualname)
            except ValueError:  # the student removed or renamed it: the checks will say so
                continue
            theirs = _find(ref, part.qualname)
            if size(theirs) >= MIN_NODES and not _is_hole(theirs) and normalised(fn) == normalised(theirs):
                copied.append(part.qualname)
    return copied


def is_a_copy(lab: Lab, copied: list[str]) -> bool:
    """Whether `copied` (copied_parts) makes the hand-in a copy: more than half of the lab's parts big enough to
    tell. One short function written the obvious way can equal the reference's (lab 3b's three-line `fork`, in a
    student's honest run); most of a lab's functions equal to it cannot be chance."""
    telling = 0
    for m in lab.modules:
        ref = ast.parse(m.reference_path.read_text())
        telling += sum(size(fn) >= MIN_NODES and not _is_hole(fn) for fn in (_find(ref, p.qualname) for p in m.parts))
    return 2 * len(copied) > telling


def _is_hole(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A reference with the part emptied (a student edition's): nothing to copy, and a starter equals it."""
    last = fn.body[-1]
    return isinstance(last, ast.Raise) and "NotImplementedError" in ast.unparse(last)


def uses_of_the_reference(lab: Lab, swaps: dict[str, str]) -> str | None:
    """Why the hand-in is refused (the first use of the reference found, with its file and line), or None."""
    for m in lab.modules:
        path = Path(swaps[m.name])
        why = _use_in(ast.parse(path.read_text()), m.name)
        if why is not None:
            line, what = why
            return (f"refused: {path.name}:{line}: {what}; a hand-in must not use the reference it replaces "
                    f"(score 0: ask your teacher if this is a mistake)")  # fmt: skip
    return None


def _use_in(tree: ast.Module, module: str) -> tuple[int, str] | None:
    package, stem = module.rsplit(".", 1)
    path_form = module.replace(".", "/")
    docstrings = {id(b[0].value) for n in ast.walk(tree) if isinstance(b := getattr(n, "body", None), list)
                  and b and _is_string_statement(b[0])}  # fmt: skip

    def names_it(text: str) -> bool:  # a message that mentions the module in passing is not a use of it
        t = text.strip().replace("\\", "/")
        return t == module or path_form in t or t == f"{stem}.py" or t.endswith(f"/{stem}.py")

    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == module or a.name.startswith(module + "."):
                    return line, f"imports {module}, the reference module"
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module)
            if base == module or (base or "").startswith(module + "."):
                return line, f"imports from {module}, the reference module"
            if base == package and any(a.name == stem for a in node.names):
                return line, f"imports {stem} from {package}: the reference module"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if names_it(node.value):
                return line, f"names the reference ({node.value!r}): to import or read it"
        elif isinstance(node, ast.Attribute) and node.attr in SOURCE_ATTRIBUTES:
            return line, f"reads a module's {node.attr} (a path into the engine's source)"
        elif isinstance(node, (ast.Attribute, ast.Name)) and (node.attr if isinstance(node, ast.Attribute)
                                                               else node.id) in SOURCE_GETTERS:  # fmt: skip
            return line, "reads source code with inspect"
    return None


def _absolute(node: ast.ImportFrom, module: str) -> str | None:
    """The module an ImportFrom names, relative levels resolved against `module`'s package."""
    if node.level == 0:
        return node.module
    parts = module.split(".")[: -node.level]
    if not parts:
        return None
    return ".".join([*parts, *([node.module] if node.module else [])])
