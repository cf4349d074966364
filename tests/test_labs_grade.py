"""Grading a class (`python -m labs grade`), the rubric, and what a check says of where a file came from.

What it is (marker `labs`):
  - `grade` over five hand-ins of lab 4 (the lab whose checks run fastest: about 20 s on the
    reference): the reference, the untouched starter, a planted bug, the reference with its
    names changed and its comments gone, and a file that does not parse. The CSV's rows exactly
    (each check's points, the total, the files' sha256, the commit, the flags, the problems),
    each student's results.json in Gradescope's shape, and each log;
  - a check that outlives the grader's limit is stopped, and is a row with 0 and the reason;
  - a hand-in that imports or reads the reference it replaces is refused before anything runs
    (score 0, `problem` says why), and no lab's reference or starter is;
  - the normaliser: a copy with its variables renamed and its comments rewritten is caught;
    another implementation of the same function is not;
  - the rubric: every check of every lab has points > 0, `partial` only where a check has
    several tests, and a partial check earns a share per test passed.

What it is not: a test of the checks themselves (tests/test_labs.py), or of Gradescope.
"""

from __future__ import annotations

import ast
import csv
import hashlib
import io
import json
import re
import shutil
import tokenize
from pathlib import Path

import pytest

from labs import classroom, cli, grading, provenance
from labs.spec import all_labs, get
from labs.starters import _find, make_starter

pytestmark = pytest.mark.labs

LAB = get("4")  # its checks run fastest; one module, four parts, a planted bug that fails exactly its checks
MODULE = LAB.modules[0]
BUG = "residual-p"  # caught by `residual` and `exactness`, and nothing else fails
BROKEN = "import torch\n\n\ndef greedy_verify(draft:\n    return draft\n"


def renamed_copy(source: str) -> str:
    """The reference as a student who copied it would hand it in: comments gone, variables renamed."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type != tokenize.COMMENT]
    text = tokenize.untokenize(tokens)
    for old, new in {"residual": "leftover", "total": "mass", "accepted": "taken", "finals": "last_tokens",
                     "counts": "how_many", "matches": "same", "valid": "real"}.items():  # fmt: skip
        text = re.sub(rf"\b{old}\b", new, text)
    return text


def hand_ins(root: Path) -> Path:
    """SUBMISSIONS/<student>/rejection_sampler.py for the five students."""
    for student in ("reference", "starter", "bug", "copy", "broken"):
        (root / student).mkdir(parents=True)
    shutil.copyfile(MODULE.reference_path, root / "reference" / MODULE.filename)
    assert cli.main(["start", LAB.id, str(root / "starter")]) == 0
    assert cli.main(["plant", LAB.id, BUG, str(root / "bug")]) == 0
    (root / "copy" / MODULE.filename).write_text(renamed_copy(MODULE.reference_path.read_text()))
    (root / "broken" / MODULE.filename).write_text(BROKEN)
    return root


def expected_row(root: Path, student: str, passed: set[str], flags: str = "", problem: str = "") -> dict:
    points = {c.id: c.points if c.id in passed else 0 for c in LAB.checks}
    sha = hashlib.sha256((root / student / MODULE.filename).read_bytes()).hexdigest()
    return {"student": student, **{k: str(v) for k, v in points.items()}, "total": str(sum(points.values())),
            "max": str(sum(c.points for c in LAB.checks)), "sha256": sha, "commit": grading.project_commit(),
            "flags": flags, "problem": problem}  # fmt: skip


@pytest.mark.teacher
def test_grade_a_class_of_five(tmp_path, capsys):
    root = hand_ins(tmp_path / "submissions")
    out = tmp_path / "grades.csv"
    assert cli.main(["grade", LAB.id, str(root), "--out", str(out), "--timeout", "300"]) == 0
    with out.open(newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == classroom.columns(LAB)
        rows = list(reader)
    assert all(float(r.pop("duration_s")) > 0 for r in rows)

    everything = {c.id for c in LAB.checks}
    caught = set(next(b for b in LAB.bugs if b.name == BUG).caught_by)
    try:
        compile(BROKEN, "f", "exec")
    except SyntaxError as e:
        broken = f"{MODULE.filename}:{e.lineno}: {e.msg} (your file does not parse)"
    assert rows == [  # sorted by student
        expected_row(root, "broken", set(), problem=broken),
        expected_row(root, "bug", everything - caught, flags="copied-reference"),
        expected_row(root, "copy", everything, flags="copied-reference"),
        expected_row(root, "reference", everything, flags="copied-reference"),
        expected_row(root, "starter", set()),
    ]

    for row in rows:  # Gradescope's results.json, beside the student's log
        student = tmp_path / "grades" / row["student"]
        res = json.loads((student / "results.json").read_text())
        assert set(res) == {"score", "max_score", "execution_time", "output", "tests"}
        assert [set(t) for t in res["tests"]] == [{"name", "score", "max_score", "output"}] * len(LAB.checks)
        assert [t["score"] for t in res["tests"]] == [int(row[c.id]) for c in LAB.checks]
        assert res["score"] == int(row["total"]) and res["max_score"] == int(row["max"])
        assert all(bool(t["output"]) == (t["score"] < t["max_score"]) for t in res["tests"])  # a failure says why
        log = (student / "check.log").read_text()
        assert log.startswith(f"student {row['student']}, lab 4: {row['total']} of {row['max']} points")
    assert json.loads((tmp_path / "grades" / "broken" / "results.json").read_text())["output"] == broken
    assert "copied-reference" in json.loads((tmp_path / "grades" / "copy" / "results.json").read_text())["output"]
    assert "passed" in (tmp_path / "grades" / "reference" / "check.log").read_text()  # pytest's output is kept
    assert "5 rows" in capsys.readouterr().out


def test_a_check_past_the_graders_limit_is_stopped_and_scored_0(tmp_path, monkeypatch):
    monkeypatch.setattr(classroom, "GRACE", 0.0)
    monkeypatch.setattr(classroom, "STOP_WAIT", 5.0)
    folder = tmp_path / "slow"
    folder.mkdir()
    shutil.copyfile(MODULE.reference_path, folder / MODULE.filename)
    report, seconds = classroom.grade_one(LAB, folder, tmp_path / "out" / "slow", timeout=0.5)
    row = classroom.csv_row(LAB, report, seconds, "c0ffee")
    assert row["total"] == 0 and row["problem"].startswith("timed out") and seconds < 30
    assert json.loads((tmp_path / "out" / "slow" / "results.json").read_text())["score"] == 0


def hand_in(tmp_path: Path, extra: str) -> Path:
    """The reference with `extra` appended: a file that passes every check, and uses the reference besides."""
    folder = tmp_path / "mine"
    folder.mkdir(exist_ok=True)
    (folder / MODULE.filename).write_text(MODULE.reference_path.read_text() + "\n" + extra)
    return folder


USES = {
    "import": "import level4_speculative.rejection_sampler as reference\n",
    "from-import": "from level4_speculative.rejection_sampler import greedy_verify as theirs\n",
    "relative": "from .rejection_sampler import greedy_verify as theirs\n",
    "the-package's": "from . import rejection_sampler\n",
    "importlib": "import importlib\nreference = importlib.import_module('level4_speculative.rejection_sampler')\n",
    "exec-open": "exec(open('/somewhere/level4_speculative/rejection_sampler.py').read())\n",
    "a-path-joined": "import os\nexec(open(os.path.join(ROOT, 'level4_speculative', 'rejection_sampler.py')).read())\n",
    "__file__": "import level4_speculative\nHERE = level4_speculative.__file__\n",
    "inspect": "import inspect\nimport level0_naive\nSOURCE = inspect.getsource(level0_naive)\n",
}


@pytest.mark.parametrize("how", USES)
def test_a_use_of_the_reference_is_found(tmp_path, how):
    why = provenance.uses_of_the_reference(LAB, grading.resolve(LAB, [hand_in(tmp_path, USES[how])]))
    assert why and why.startswith(f"refused: {MODULE.filename}:"), why


def test_a_hand_in_that_imports_the_reference_is_refused(tmp_path, capsys):
    folder = hand_in(tmp_path, USES["import"])
    assert cli.main(["check", LAB.id, str(folder), "--json"]) == 2
    rep = json.loads(capsys.readouterr().out)
    assert (
        rep["problem"].startswith(f"refused: {MODULE.filename}:")
        and "level4_speculative.rejection_sampler" in (rep["problem"])
    )
    assert rep["points"] == 0 and rep["score"] == 0 and rep["max_points"] == sum(c.points for c in LAB.checks)
    assert rep["sha256"] == {MODULE.filename: hashlib.sha256((folder / MODULE.filename).read_bytes()).hexdigest()}
    assert cli.main(["check", LAB.id, str(folder)]) == 2 and "refused" in capsys.readouterr().err


@pytest.mark.parametrize("lab", all_labs(), ids=lambda lab: lab.id)
def test_no_reference_or_starter_is_refused_and_only_the_reference_is_a_copy(lab, tmp_path):
    reference, starter = {}, {}
    for m in lab.modules:  # copies: the reference's own file, checked in place, is a student edition's
        for kind, files, text in [("reference", reference, m.reference_path.read_text()),
                                  ("starter", starter, make_starter(lab, m))]:  # fmt: skip
            (tmp_path / kind).mkdir(exist_ok=True)
            (tmp_path / kind / m.filename).write_text(text)
            files[m.name] = str(tmp_path / kind / m.filename)
    assert provenance.copied_parts(lab, {m.name: str(m.reference_path) for m in lab.modules}) == []
    assert provenance.uses_of_the_reference(lab, reference) is None
    assert provenance.uses_of_the_reference(lab, starter) is None
    big = [
        p.qualname
        for m in lab.modules
        for p in m.parts
        if provenance.size(_find(ast.parse(m.reference_path.read_text()), p.qualname)) >= provenance.MIN_NODES
    ]
    assert provenance.copied_parts(lab, reference) == big and big  # fmt: skip
    assert provenance.copied_parts(lab, starter) == []
    # a copy is most of the telling parts: one function that matches (written the obvious way) is not
    assert provenance.is_a_copy(lab, big)
    if len(big) >= 2:
        assert not provenance.is_a_copy(lab, big[:1])


def function(source: str) -> ast.FunctionDef:
    return next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))


REFERENCE = MODULE.reference_path.read_text()
REFERENCE_GREEDY = ast.get_source_segment(REFERENCE, _find(ast.parse(REFERENCE), "greedy_verify"))


def test_the_normaliser_sees_through_renamed_variables():
    renamed = function(renamed_copy(REFERENCE_GREEDY))  # `matches`, `valid`, `counts` renamed; comments gone
    assert ast.unparse(renamed) != ast.unparse(function(REFERENCE_GREEDY))
    assert provenance.normalised(renamed) == provenance.normalised(function(REFERENCE_GREEDY))


def test_the_normaliser_tells_another_implementation_apart():
    mine = function('''
def greedy_verify(draft, num_draft, target_tokens):
    """Accept while the draft matches the target's token; then the target's."""
    emitted, counts = [], []
    for i in range(draft.shape[0]):
        a = 0
        while a < int(num_draft[i]) and int(draft[i, a]) == int(target_tokens[i, a]):
            a += 1
        emitted.append(draft[i, :a].tolist() + [int(target_tokens[i, a])])
        counts.append(a)
    return emitted, counts
''')
    assert provenance.normalised(mine) != provenance.normalised(function(REFERENCE_GREEDY))


@pytest.mark.parametrize("lab", all_labs(), ids=lambda lab: lab.id)
def test_every_check_has_points_and_partial_only_with_several_tests(lab):
    for c in lab.checks:
        assert isinstance(c.points, int) and c.points > 0, f"lab {lab.id}'s check {c.id} has no points"
        assert not c.partial or len(c.tests) > 1, f"lab {lab.id}'s check {c.id} is partial with one test"


def test_a_partial_check_earns_a_share_per_test_passed():
    engine = LAB.check("engine")  # partial, two tests
    exactness = LAB.check("exactness")  # all or nothing, one test (a family of two)
    assert engine.partial and len(engine.tests) == 2 and not exactness.partial
    records = [dict(nodeid=engine.tests[0], outcome="passed", when="call", message=""),
               dict(nodeid=engine.tests[1], outcome="failed", when="call", message="no"),
               dict(nodeid=exactness.tests[0] + "[True]", outcome="passed", when="call", message=""),
               dict(nodeid=exactness.tests[0] + "[False]", outcome="failed", when="call", message="no")]  # fmt: skip
    rep = grading.grade(LAB, records, checks=[engine, exactness])
    assert [(c.points, c.max_points) for c in rep.checks] == [(engine.points / 2, engine.points), (0, exactness.points)]
    assert (
        rep.as_dict()["points"] == engine.points / 2 and rep.as_dict()["max_points"] == engine.points + exactness.points
    )
