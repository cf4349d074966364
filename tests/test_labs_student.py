"""The student edition (labs/student_edition.py): the project with a lab's functions emptied, and no solution in it.

What it is (marker `labs`): labs 1 and 3 exported once into a temporary folder (over an older student edition,
with `force`, which it replaces), then, in the copy:
  - every function of their parts raises NotImplementedError when called (the copy's own modules, imported in
    a process started there), and every level still imports;
  - no line of the reference's bodies of those functions is anywhere in the copy (a normalised grep of every
    text file; the trivial lines aside, and a line the copy's own code runs too, which quotes nothing);
  - no lab definition holds a planted bug, lab 1's and lab 3's say no more than `short` guidance (a check's
    hint is its rule), and `python -m labs plant` refuses in one line: it is the teacher's;
  - lab 1's checks, as a student runs them there (`python -m labs check 1 FILES --json`, cwd the copy), all
    fail with NotImplementedError as exported, and all pass once the reference modules are copied back;
  - `export_student` refuses a folder that is not empty, and, even with `force`, one that is not a student
    edition;
  - in a second copy with the reference modules copied back, the labs' own text tests (handouts, guidance)
    pass there, those that read the teacher's material (marker `teacher`) skipped; the whole suite was run
    so once by hand (docs/course/running.md).

Lab 1 and lab 3 are quick: their checks are unit tests of the block allocator, tables, hashes and pool.
The export copies what git lists (about 25 MB, the model files included) in a few seconds.

What it is not: a test of the labs' checks (tests/test_labs.py) or of the starters (labs/starters.py).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from labs import spec, student_edition
from labs.grading import LabsError
from labs.spec import REPO

pytestmark = [
    pytest.mark.labs,
    pytest.mark.skipif(student_edition.is_student_edition(), reason="a student edition exports nothing"),
    pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout"),
]

LABS = ["1", "3"]
CHECKED = "1"  # the lab whose checks run in the copy, holed and restored


def env() -> dict:
    """A process in the copy imports the copy: nothing on the path points back at the teacher's repository."""
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LABS_SWAP")}
    return e


def run(copy: Path, *argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=copy, env=env(), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("student") / "edition"
    dest.mkdir()
    (dest / student_edition.MARKER).write_text("an older student edition\n")
    (dest / "stale.py").write_text("the older edition's file\n")
    student_edition.export_student(dest, LABS, force=True)
    return dest


def rel(module: spec.Module) -> str:
    return module.reference_path.relative_to(REPO).as_posix()


def norm(line: str) -> str:
    return " ".join(line.split())


def reference_body_lines(lab: spec.Lab) -> set[str]:
    """The reference's lines in the bodies of the lab's parts (docstrings and comments aside), normalised, less
    the trivial ones (`return out`, `else:`: under 12 characters or fewer than three words)."""
    out = set()
    for m in lab.modules:
        source = m.reference_path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        for part in m.parts:
            node = tree
            for name in part.qualname.split("."):
                node = next(n for n in node.body if getattr(n, "name", None) == name)
            body = node.body
            doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            start = body[0].end_lineno if doc else body[0].lineno - 1
            for line in lines[start : node.end_lineno]:
                n = norm(line.split("  #")[0])
                if n and not n.startswith("#") and len(n) >= 12 and len(re.findall(r"\w+", n)) >= 3:
                    out.add(n)
    return out


def test_the_copy_is_marked_and_the_older_edition_is_gone(copy):
    marker = (copy / student_edition.MARKER).read_text()
    assert not (copy / "stale.py").exists()
    assert student_edition.is_student_edition(copy)
    for lab_id in LABS:
        assert f"python -m labs check {lab_id} " in marker
    assert "short" in marker and "commit" in marker
    assert (copy / "labs" / "student_edition.py").is_file() and not (copy / ".git").exists()


def test_the_holed_functions_raise_not_implemented_in_the_copy(copy):
    parts = [(m.name, p.qualname) for lab_id in LABS for m in spec.get(lab_id).modules for p in m.parts]
    probe = f"""
import importlib, inspect, json
for level in ("level0_naive", "level1_paged", "level2_continuous", "level3_prefix", "level4_speculative",
              "level5_multigpu", "level6_serving"):  # the holes stop no import
    importlib.import_module(level)
out = {{}}
for module, qualname in {parts!r}:
    mod = importlib.import_module(module)
    assert mod.__file__.startswith({str(copy)!r}), mod.__file__
    obj = mod
    for name in qualname.split("."):
        obj = getattr(obj, name)
    args = [None] * sum(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                        for p in inspect.signature(obj).parameters.values())
    try:
        obj(*args)
        out[qualname] = "returned"
    except NotImplementedError as e:
        out[qualname] = "NotImplementedError: " + str(e)
    except Exception as e:
        out[qualname] = type(e).__name__
print(json.dumps(out))
"""
    proc = run(copy, "-c", probe)
    assert proc.returncode == 0, proc.stderr
    raised = json.loads(proc.stdout.splitlines()[-1])
    assert raised and all(v.startswith("NotImplementedError") for v in raised.values()), raised


def test_no_reference_line_is_left_anywhere_in_the_copy(copy):
    secrets = set().union(*(reference_body_lines(spec.get(lab_id)) for lab_id in LABS))
    assert len(secrets) > 20  # the grep greps for something
    hits = []
    for path in copy.rglob("*"):
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            n = norm(line)
            for s in secrets:
                # a line of the copy's own code that is exactly the reference's (a loop header a test writes too)
                # runs there, it quotes nothing; anything else that holds one is a quote
                if s in n and not (path.suffix == ".py" and norm(line.split("  #")[0]) == s):
                    hits.append(f"{path.relative_to(copy)}:{i}: {s}")
    assert not hits, "\n".join(hits[:20])


def test_no_planted_bug_and_no_more_guidance_than_chosen(copy):
    for toml in (copy / "labs").glob("lab*.toml"):
        assert "[[bugs]]" not in toml.read_text(), toml.name
    for lab_id in LABS:
        lab = spec.load(copy / "labs" / f"lab{lab_id}.toml")
        assert not lab.bugs
        assert all(c.hint == c.rule for c in lab.checks)
        assert lab.checks == tuple(dataclasses.replace(c, hint=c.rule) for c in spec.get(lab_id).checks)
    full = spec.load(copy / "labs" / "lab2.toml")  # a lab not assigned keeps its hints: its reference is there
    assert [c.hint for c in full.checks] == [c.hint for c in spec.get("2").checks]
    assert not (copy / "docs" / "course" / "answer_keys.md").exists() and (REPO / "docs/course/answer_keys.md").exists()
    # no handout keeps its teacher's note (which check catches which planted bug), and nothing else is lost
    for handout in (copy / "docs" / "labs").glob("lab*.md"):
        mine, theirs = handout.read_text(), (REPO / "docs" / "labs" / handout.name).read_text()
        assert "## For teachers" in theirs and "## For teachers" not in mine, handout.name
        headings = lambda text: [h for h in re.findall(r"^## .*", text, re.M) if h != "## For teachers"]  # noqa: E731
        assert headings(mine) == headings(theirs), handout.name


def test_plant_refuses_in_the_student_edition(copy, tmp_path):
    bug = spec.get(CHECKED).bugs[0].name
    proc = run(copy, "-m", "labs", "plant", CHECKED, bug, str(tmp_path / "bugs"), timeout=60)
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "teacher" in proc.stderr, proc.stderr
    assert not (tmp_path / "bugs").exists()


CHECK_BOTH = """
import json, sys, tempfile
from pathlib import Path
from labs import grading, spec
lab = spec.get(sys.argv[1])
runs = {"holed": grading.resolve(lab, sys.argv[2].split(",")), "reference": grading.resolve(lab, [sys.argv[3]])}
with tempfile.TemporaryDirectory() as work:
    work = Path(work)
    variants = [grading.check_variant(name, lab, swaps, work, expect_failures=name == "holed")
                for name, swaps in runs.items()]
    summary = grading.run_plan(variants, work, jobs=2)
    print(json.dumps({v["name"]: grading.grade(lab, grading.read_results(v["results"]), summary[v["name"]]).as_dict()
                      for v in variants}))
"""


def test_the_checks_fail_on_the_holes_and_pass_on_the_reference(copy, tmp_path):
    """As `python -m labs check 1 FILES` grades them in the copy (its labs, its tests, its engine): the copy's own
    files, holed, and the reference modules copied out of the teacher's tree, as a finished student hands them in.
    One runner for both (the holed run stops each check at its first failure), so torch is imported once."""
    lab = spec.get(CHECKED)
    for m in lab.modules:
        shutil.copyfile(m.reference_path, tmp_path / m.filename)
    proc = run(copy, "-c", CHECK_BOTH, CHECKED, ",".join(rel(m) for m in lab.modules), str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.splitlines()[-1])
    holed, reference = report["holed"], report["reference"]
    assert holed["problem"] is None, holed["problem"]  # the copy imports: only the holes fail
    assert holed["score"] == 0 and holed["total"] == len(lab.checks)
    for c in holed["checks"]:
        assert any("NotImplementedError" in d for d in c["details"]), c
    assert reference["passed"], json.dumps(reference, indent=1)


def test_the_copys_own_tests_pass_with_the_references_restored(tmp_path):
    """A student edition is a project whose tests pass once the student's code is the reference's; what
    reads the teacher's material (planted bugs, teacher notes, full guidance) skips itself there."""
    dest = tmp_path / "edition"
    student_edition.export_student(dest, LABS)
    for lab_id in LABS:
        for m in spec.get(lab_id).modules:
            shutil.copyfile(m.reference_path, dest / rel(m))
    proc = run(dest, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/test_labs_docs.py",
               "tests/test_labs_guidance.py", timeout=600)  # fmt: skip
    tail = proc.stdout[-3000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    skipped = re.search(r"(\d+) skipped", proc.stdout)
    assert skipped and int(skipped[1]) >= 18, tail  # at least the teacher notes of the 18 labs


def test_export_refuses_a_folder_it_would_overwrite(tmp_path):
    (tmp_path / "mine.txt").write_text("a student's work")
    with pytest.raises(LabsError, match="--force"):
        student_edition.export_student(tmp_path, LABS)
    with pytest.raises(LabsError, match="not a student edition"):
        student_edition.export_student(tmp_path, LABS, force=True)
    assert (tmp_path / "mine.txt").read_text() == "a student's work"
    with pytest.raises(LabsError, match="there is no lab"):
        student_edition.export_student(tmp_path / "new", ["9"])
