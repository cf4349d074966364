"""The student edition: a copy of the project with the assigned labs' functions emptied, and no solution in it.

What it is: `export_student(dest, lab_ids)` (`python -m labs export-student DIR --labs 2,3b`), which
writes into DEST every file git lists (tracked, and new files git does not ignore; the working tree's
version of each), then:

  - each assigned lab's reference modules become its starters (`labs.starters.make_starter`, at the
    teacher's `guidance`), in place: the engine in the copy runs the student's code, and a hole raises
    NotImplementedError only when it is called, so everything else still imports and runs;
  - every lab's definition loses its planted bugs (`[[bugs]]`: their `old` strings are reference
    lines), and an assigned lab's keeps no more than the guidance: under `short` or `none` a part's
    walk-through (`hint`) becomes its goal and nudge (or its goal), and a check's full hint its rule;
  - every handout loses its "## For teachers" section (which check catches which planted bug), and
    the experiments' answer keys (`TEACHERS_ONLY`) are not copied;
  - every other file is searched for the lines the starters removed (normalised, the trivial ones left
    out, and those the copy's own code runs anyway left in): in a document, a code block's line
    becomes a placeholder and a quote in prose is cut; in Python, only strings and comments quote, and
    they are cut the same way (the same words cut the same way, so a test that compares a handout with
    its own quote of it still agrees);
  - `STUDENT_EDITION.md` at the root says which labs are holed, the guidance, the source commit and
    how to check one's work. `is_student_edition()` looks for it: `python -m labs plant` refuses there.

What it is not: a sandbox, or a guarantee against a solution found elsewhere (the published project,
another student). The teacher's repository is never changed.

Reference: nbgrader's "release" step (the student version of an assignment, solutions stripped).
"""

from __future__ import annotations

import ast
import inspect
import io
import re
import shutil
import subprocess
import tokenize
from datetime import datetime, timezone
from pathlib import Path

from . import spec
from .grading import LabsError
from .spec import REPO
from .starters import _find, make_starter

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

MARKER = "STUDENT_EDITION.md"
TEACHERS_ONLY = ("docs/course/answer_keys.md",)  # files a student edition leaves out whole
PLANT_REFUSAL = "plant is the teacher's: this is a student edition (STUDENT_EDITION.md), which has no planted bugs"
GUIDANCE = getattr(spec, "GUIDANCE", ("none", "short", "full"))
DEFAULT_GUIDANCE = getattr(spec, "DEFAULT_GUIDANCE", "short")
PLACEHOLDER = "(lab {lab}: yours to write)"
WORD = re.compile(r"\w+")


def is_student_edition(root: Path = REPO) -> bool:
    """Whether `root` (this project, by default) is a student edition: its marker file is there."""
    return (Path(root) / MARKER).is_file()


def export_student(dest: Path, lab_ids: list[str], force: bool = False, guidance: str = DEFAULT_GUIDANCE) -> None:
    """Write the student edition with `lab_ids` holed into `dest` (new or empty; with `force`, an older
    student edition there is replaced)."""
    if is_student_edition():
        raise LabsError("this is a student edition already: export from the teacher's repository")
    if guidance not in GUIDANCE:
        raise LabsError(f"guidance {guidance!r}: choose one of {', '.join(GUIDANCE)}")
    labs = _labs(lab_ids)
    dest = Path(dest).expanduser().resolve()
    _prepare(dest, force)
    try:
        cut = _export(dest, labs, guidance)
    except BaseException:  # half a copy may hold a reference not yet emptied: none is left behind
        shutil.rmtree(dest, ignore_errors=True)
        raise
    (dest / MARKER).write_text(marker_text(labs, guidance, cut))


def _export(dest: Path, labs: list[spec.Lab], guidance: str) -> dict[str, int]:
    """The copy, its holes, its lab definitions, its quotes cut: {file: lines cut}."""
    files = project_files()
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, target, follow_symlinks=False)
    holed: dict[str, str] = {}  # the holed modules, relative path -> lab id
    for lab in labs:
        for m in lab.modules:
            rel = m.reference_path.relative_to(REPO).as_posix()
            if rel in holed:
                raise LabsError(f"labs {holed[rel]} and {lab.id} both empty {rel}: export them separately")
            (dest / rel).write_text(_starter(lab, m, guidance))
            holed[rel] = lab.id
    for path in sorted((dest / "docs" / "labs").glob("lab*.md")):  # a handout's note names the planted bugs
        path.write_text(without_teachers_note(path.read_text()))
    assigned = {lab.id for lab in labs}
    for path in sorted((dest / "labs").glob("lab*.toml")):
        lab_id = tomllib.loads(path.read_text())["id"]
        path.write_text(student_toml(path.read_text(), guidance if lab_id in assigned else "full"))
    secrets = reference_lines(labs, dest)
    cut = scrub(dest, secrets, skip=set(holed))
    left = find_quotes(dest, secrets, skip=set(holed))
    if left:
        raise LabsError(f"the student edition still quotes the reference: {left[0]}")
    return cut


def _labs(lab_ids: list[str]) -> list[spec.Lab]:
    ids = list(dict.fromkeys(str(i).strip().lower() for i in lab_ids if str(i).strip()))
    if not ids:
        raise LabsError("name the labs to empty, e.g. --labs 2,3b")
    try:
        return [spec.get(i) for i in ids]
    except ValueError as e:
        raise LabsError(str(e)) from None


def _prepare(dest: Path, force: bool) -> None:
    if dest == REPO or dest in REPO.parents or REPO in dest.parents:
        raise LabsError(f"{dest}: the student edition goes outside the repository")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        if not force:
            raise LabsError(f"{dest} exists and is not empty; use --force to replace an older student edition there")
        if not is_student_edition(dest):
            raise LabsError(f"{dest} is not a student edition (no {MARKER}): it is not replaced, even with --force")
        shutil.rmtree(dest)
    dest.mkdir(parents=True, exist_ok=True)


def project_files() -> list[str]:
    """What git lists, relative to the repository: the tracked files and the new ones it does not ignore,
    those of them that are in the working tree (a deleted file is not)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as e:
        raise LabsError(f"the student edition is made from a git checkout of the project ({e})") from None
    files = dict.fromkeys(f for f in out.split("\0") if f and f not in TEACHERS_ONLY)
    return [f for f in files if (REPO / f).is_file() or (REPO / f).is_symlink()]


def _starter(lab: spec.Lab, module: spec.Module, guidance: str) -> str:
    kwargs = {"guidance": guidance} if "guidance" in inspect.signature(make_starter).parameters else {}
    try:
        return make_starter(lab, module, **kwargs)
    except ValueError as e:  # a level changed under the lab (a part renamed)
        raise LabsError(f"lab {lab.id}'s starter cannot be made from today's reference: {e}") from None


def source_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "HEAD") or "unknown"
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return sha + (" with uncommitted changes" if dirty else "")


# --- the lab definitions: no planted bugs, no more guidance than chosen ------------------------------------------


def _statements(text: str) -> list[tuple[str, str | None, str]]:
    """A TOML file as (kind, name, text) pieces that add up to it: kind "header" (name: the table, `[[bugs]]`),
    "key" (name: the key; its text is the whole statement, a multi-line string or array included), or "other"
    (blank lines, comments)."""
    lines = text.splitlines(keepends=True)
    out, i = [], 0
    while i < len(lines):
        s = lines[i].strip()
        if s.startswith("["):
            out.append(("header", s, lines[i]))
            i += 1
        elif not s or s.startswith("#"):
            out.append(("other", None, lines[i]))
            i += 1
        else:  # a key's statement ends at the first line after which it parses on its own
            key = s.split("=", 1)[0].strip()
            j = i + 1
            while j <= len(lines):
                try:
                    tomllib.loads("".join(lines[i:j]))
                    break
                except tomllib.TOMLDecodeError:
                    j += 1
            out.append(("key", key, "".join(lines[i:j])))
            i = j
    return out


def without_teachers_note(handout: str) -> str:
    """A handout without its "## For teachers" section (what each check catches, the planted bugs, which check
    catches which: a student who reads it knows where the bug is before looking)."""
    return re.sub(r"\n## For teachers\n.*?(?=\n## |\Z)", "\n", handout, flags=re.S)


def toml_string(s: str) -> str:
    """`s` as a TOML multi-line basic string."""
    body = s.strip("\n").replace("\\", "\\\\").replace('"""', '""\\"')
    if body.endswith('"'):
        body = body[:-1] + '\\"'
    return f'"""\n{body}"""'


def student_toml(text: str, guidance: str) -> str:
    """A lab's definition without its planted bugs and, below `full` guidance, without the walk-throughs: a
    part's `hint` says only what its starter says (`goal` and `nudge`, or `goal`), a check's `hint` its `rule`."""
    data = tomllib.loads(text)
    parts = [p for m in data.get("modules", []) for p in m.get("parts", [])]
    checks = data.get("checks", [])
    out, table, n_part, n_check = [], None, -1, -1
    for kind, name, piece in _statements(text):
        if kind == "header":
            table = name
            n_part += table == "[[modules.parts]]"
            n_check += table == "[[checks]]"
        if table == "[[bugs]]" and kind != "other":
            continue
        if kind == "key" and guidance != "full":
            if table == "[[modules.parts]]" and "goal" in parts[n_part]:
                p = parts[n_part]
                said = p["goal"].strip() + ("\n" + p.get("nudge", "").strip() if guidance == "short" else "")
                if name == "hint":
                    piece = f"hint = {toml_string(said)}\n"
                elif name == "nudge" and guidance == "none":
                    piece = 'nudge = ""\n'
            elif table == "[[checks]]" and name == "hint":
                piece = f"hint = {toml_string(checks[n_check]['rule'])}\n"
        out.append(piece)
    new = re.sub(r"\n{3,}", "\n\n", "".join(out))
    tomllib.loads(new)  # still a lab's definition
    return new


# --- the reference lines, and where the copy quotes them ----------------------------------------------------------


def norm(line: str) -> str:
    return " ".join(line.split())


def trivial(line: str) -> bool:
    """Too common to give anything away: `return out`, `else:`, `i += 1`."""
    return len(line) < 12 or len(WORD.findall(line)) < 3


def code_lines(source: str) -> list[str]:
    """Each line of a Python source without its comment, normalised."""
    lines = source.splitlines()
    cut = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                cut[tok.start[0] - 1] = tok.start[1]
    except (tokenize.TokenError, SyntaxError):
        pass
    return [norm(line[: cut[i]] if i in cut else line) for i, line in enumerate(lines)]


def removed_lines(lab: spec.Lab, module: spec.Module) -> set[str]:
    """The reference's lines of the lab's functions in `module` (docstrings aside), normalised, that its
    starter does not keep, and that are not trivial."""
    source = module.reference_path.read_text()
    lines = code_lines(source)
    kept = set(code_lines(_starter(lab, module, "full")))
    tree = ast.parse(source)
    out = set()
    for part in module.parts:
        fn = _find(tree, part.qualname)
        first = fn.body[0]
        has_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
        start = first.end_lineno if has_doc else first.lineno - 1
        out |= {n for n in lines[start : fn.end_lineno] if n and not trivial(n) and n not in kept}
    return out


def reference_lines(labs: list[spec.Lab], root: Path) -> dict[str, str]:
    """{normalised reference line: lab id} for the lines the labs' starters removed, less the ones the code
    of the copy at `root` runs anyway (a line of another module is not a quote, and cannot go)."""
    holed = {m.reference_path.relative_to(REPO).as_posix() for lab in labs for m in lab.modules}
    elsewhere = set()
    for path in Path(root).rglob("*.py"):
        if path.relative_to(root).as_posix() not in holed:
            elsewhere |= set(code_lines(_read(path) or ""))
    return {n: lab.id for lab in labs for m in lab.modules for n in removed_lines(lab, m) if n not in elsewhere}


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (UnicodeDecodeError, OSError):
        return None


def _pattern(line: str) -> re.Pattern:
    return re.compile(r"\s+".join(map(re.escape, line.split())))


def _text_files(root: Path, skip: set[str]):
    for path in sorted(Path(root).rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not path.is_symlink() and rel not in skip and rel != MARKER:
            text = _read(path)
            if text is not None:
                yield rel, path, text


def _quoting_lines(rel: str, text: str) -> set[int]:
    """The lines (0-based) where `text` may quote code: all of them, but in Python only strings and comments."""
    lines = text.splitlines()
    if not rel.endswith(".py"):
        return set(range(len(lines)))
    out = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
                out |= set(range(tok.start[0] - 1, tok.end[0]))
    except (tokenize.TokenError, SyntaxError):
        return set(range(len(lines)))
    return out


def find_quotes(root: Path, secrets: dict[str, str], skip: set[str] = frozenset()) -> list[str]:
    """`file:line: reference line` for every place in the copy that quotes one of `secrets`."""
    hits = []
    for rel, _path, text in _text_files(root, skip):
        flat = norm(text)
        if not any(s in flat for s in secrets):
            continue
        lines = text.splitlines()
        for i in sorted(_quoting_lines(rel, text)):
            n = norm(lines[i])
            hits += [f"{rel}:{i + 1}: {s}" for s in secrets if s in n]
    return hits


def scrub(root: Path, secrets: dict[str, str], skip: set[str] = frozenset()) -> dict[str, int]:
    """Cut every quote of `secrets` in the copy: in a Markdown code block the whole line becomes a placeholder,
    elsewhere the quoted words do. {file: lines changed}."""
    changed = {}
    patterns = {s: _pattern(s) for s in secrets}
    for rel, path, text in _text_files(root, skip):
        flat = norm(text)
        if not any(s in flat for s in secrets):
            continue
        lines = text.splitlines(keepends=True)
        quoting = _quoting_lines(rel, text)
        fenced, n = _fenced(lines) if rel.endswith(".md") else set(), 0
        for i in sorted(quoting):
            found = [s for s in secrets if s in norm(lines[i])]
            if not found:
                continue
            n += 1
            if i in fenced:
                indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
                lines[i] = f"{indent}... {PLACEHOLDER.format(lab=secrets[found[0]])}\n"
                continue
            for s in found:
                lines[i] = patterns[s].sub(PLACEHOLDER.format(lab=secrets[s]), lines[i])
        if n:
            path.write_text("".join(lines))
            changed[rel] = n
    return changed


def _fenced(lines: list[str]) -> set[int]:
    out, inside = set(), False
    for i, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            inside = not inside
        elif inside:
            out.add(i)
    return out


# --- the marker -------------------------------------------------------------------------------------------------


def marker_text(labs: list[spec.Lab], guidance: str, cut: dict[str, int]) -> str:
    rows = []
    for lab in labs:
        paths = [m.reference_path.relative_to(REPO).as_posix() for m in lab.modules]
        rows.append(f"| {lab.id} | {lab.topic} | {', '.join(f'`{p}`' for p in paths)} | "
                    f"`python -m labs check {lab.id} {' '.join(paths)}` |")  # fmt: skip
    quoted = "".join(f"- `{rel}`: {n} line{'s' * (n != 1)}\n" for rel, n in sorted(cut.items())) or "- none\n"
    table, placeholder = "\n".join(rows), PLACEHOLDER.format(lab="N")
    return f"""# Student edition

This copy of the project is a student edition: the functions of the labs below are empty (each raises
NotImplementedError, with a comment that says what to write), and the copy holds no solution to them. Everything
else is the real engine, which runs your code: fill in the functions where they are, then check your work.

| lab | topic | your files | check your work |
|---|---|---|---|
{table}

- Guidance (how much each TODO and each failed check's hint says): {guidance}
- Made from commit {source_commit()} on {datetime.now(timezone.utc):%Y-%m-%d}.
- Check your work from this folder: `python -m labs check LAB FILE ...` (above), `--json` for one JSON object. Each lab's
  handout is in docs/labs/; `python -m labs experiment LAB FILE ...` runs its experiment with your code.
- Your files are the ones above, where they are: a handout's `python -m labs start LAB DIR` copies them out, if
  you prefer to work elsewhere (then check DIR). Its "do not open the reference" holds no more: here it is yours.
- A check that runs the engine runs every lab's code the engine reaches: while another lab of this edition is still
  empty, such a check can fail on it (lab 4's engine check forks sequences, so it needs lab 3b's copy-on-write);
  the failure names that lab ("NotImplementedError: lab 3b: write ...").
- The planted bugs and `python -m labs plant` are the teacher's: not in this edition.

Lines that quoted the solution were cut here (each became "{placeholder}"):

{quoted}"""
