"""Grading: turn a lab and a student's files into a plan, run it, and read the checks back.

What it is: the part `python -m labs check` and tests/test_labs.py share.

  - `resolve(lab, paths)`: the student's files (a directory, or files named like the
    reference modules) -> `{module: absolute path}`, with a clear error for a missing or
    misnamed file and for one that does not parse (the line and the message, before any
    engine starts).
  - `check_variant(...)`: one plan variant, the lab's checks under the student's swaps.
  - `run_plan(variants)`: `python -m labs.runner plan` in a subprocess; returns when all
    variants have run.
  - `grade(lab, results, hints=...)`: each check passed or not, with its hint at the
    teacher's level (`--hints`) and the first failure message, and the score: the JSON
    `--json` prints. `not_run(lab_id, problem)` is the same report when the checks could not
    run at all (a file that does not parse): score 0, and the reason in `problem`.
  - `check(lab, paths)`: all of it, in a temporary folder that is gone when it returns. Before
    anything runs, `labs/provenance.py` reads the files: one that imports or reads the reference
    it replaces is refused (a `LabsError`: score 0, the reason in `problem`); one whose functions
    are the reference's up to names and comments is flagged `copied-reference` and scored.
  - Points: each check's `points` (the lab's rubric, in its .toml), all or nothing, or with
    `partial` a share per test passed; the report's `points` of `max_points`, with what a class's
    grade sheet needs besides (`duration_s`, each file's `sha256`, the project's `commit`, `flags`).
  - `banner_hints(lab_id, paths)`: the `--hints` level when the teacher names none: the
    guidance level the student's starter was made at (its banner's `# guidance:` line; the
    least of several files'), so a failed check says no more than the starter did.

What it is not: the checks themselves (the level's tests and `labs/lab<id>_checks.py`).

Reference: nbgrader's autograde output (one line per test, points, a total).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import provenance
from .runner import matches
from .spec import DEFAULT_HINTS, GUIDANCE, REPO, Check, Lab, get
from .starters import guidance_of


class LabsError(ValueError):
    """A problem with what the student handed in, said in one line."""


def resolve(lab: Lab, paths: list[str | Path]) -> dict[str, str]:
    """The student's files for each module of the lab, absolute."""
    files: dict[str, Path] = {}
    for p in map(Path, paths):
        p = p.expanduser()
        if p.is_dir():
            for m in lab.modules:
                if (p / m.filename).is_file():
                    files.setdefault(m.filename, p / m.filename)
        elif p.is_file():
            if len(lab.modules) == 1:
                files[lab.modules[0].filename] = p
            elif lab.module_for_file(p.name) is not None:
                files[p.name] = p
            else:
                raise LabsError(f"{p}: lab {lab.id} has files named {', '.join(m.filename for m in lab.modules)}; "
                                f"name yours the same (or give the directory that holds them)")  # fmt: skip
        else:
            raise LabsError(f"{p}: no such file or directory")
    missing = [m.filename for m in lab.modules if m.filename not in files]
    if missing:
        raise LabsError(f"lab {lab.id} needs {', '.join(missing)} too (get its starter with "
                        f"`python -m labs start {lab.id} DIR`)")  # fmt: skip
    swaps = {}
    for m in lab.modules:
        path = files[m.filename].resolve()
        try:
            compile(path.read_text(), str(path), "exec")
        except SyntaxError as e:
            raise LabsError(f"{path}:{e.lineno}: {e.msg} (your file does not parse)") from None
        swaps[m.name] = str(path)
    return swaps


def check_variant(name: str, lab: Lab, swaps: dict[str, str], workdir: Path, checks: list[Check] | None = None,
                  timeout: float = 900, expect_failures: bool = False) -> dict:  # fmt: skip
    """`expect_failures`, for runs that only need to know *that* each check fails (a starter, a planted
    bug): hypothesis reports a failure without minimising it, and a check stops at its first failure."""
    checks = checks or lab.checks
    tests = list(dict.fromkeys(t for c in checks for t in c.tests))
    safe = name.replace("/", "_")
    return dict(name=name, kind="pytest", swaps=swaps, tests=tests, timeout=timeout, no_shrink=expect_failures,
                stop_checks=[list(c.tests) for c in checks] if expect_failures else None,
                results=str(workdir / f"{safe}.jsonl"), log=str(workdir / f"{safe}.log"))  # fmt: skip


def module_variant(name: str, swaps: dict[str, str], module: str, argv: list[str], workdir: Path,
                   timeout: float = 900) -> dict:  # fmt: skip
    safe = name.replace("/", "_")
    return dict(name=name, kind="module", swaps=swaps, module=module, argv=list(argv), timeout=timeout,
                results=str(workdir / f"{safe}.jsonl"), log=str(workdir / f"{safe}.log"))  # fmt: skip


def subprocess_env(extra: dict | None = None) -> dict:
    """The environment of a labs subprocess: the repository importable whatever the cwd."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("LABS_SWAP", None)
    # the checks and experiments build many engines, each a compile by default on a CPU (seconds to a
    # minute): eager unless the student's shell says otherwise (lab 1c's asks for compilation itself)
    env.setdefault("LADDER_COMPILE_LEVEL", "0")
    env.update(extra or {})
    return env


def run_plan(variants: list[dict], workdir: Path, jobs: int = 1) -> dict[str, dict]:
    """Run the variants in one warm `python -m labs.runner plan` process; {name: summary}.

    The runner's temporary folder is `workdir/tmp`: what the checks write there (pytest's
    tmp_path, multiprocessing's folders, which a forked variant's `os._exit` never removes)
    goes when the workdir goes."""
    plan = dict(variants=variants, jobs=jobs, summary=str(workdir / "summary.json"))
    path = workdir / "plan.json"
    path.write_text(json.dumps(plan, indent=1))
    (workdir / "tmp").mkdir(exist_ok=True)
    env = subprocess_env({"TMPDIR": str(workdir / "tmp")})
    proc = subprocess.run([sys.executable, "-m", "labs.runner", "plan", str(path)], cwd=REPO, env=env,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0 or not Path(plan["summary"]).is_file():
        raise RuntimeError(f"the labs runner failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return {s["name"]: s for s in json.loads(Path(plan["summary"]).read_text())}


def read_results(path: str | Path) -> list[dict]:
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []


@dataclass
class CheckResult:
    id: str
    title: str
    passed: bool
    hint: str | None  # at the report's level of hints: None under --hints none
    details: list[str] = field(default_factory=list)  # what failed, one line per test
    points: float = 0  # earned: all of max_points, none, or (a `partial` check) a share per test passed
    max_points: int = 0  # the check's weight in the lab's rubric

    def as_dict(self) -> dict:
        return dict(id=self.id, title=self.title, passed=self.passed, hint=None if self.passed else self.hint,
                    details=self.details, points=self.points, max_points=self.max_points)  # fmt: skip


@dataclass
class Report:
    lab: str
    checks: list[CheckResult]
    problem: str | None = None  # the checks could not run, the student's file did not import, or the run timed out
    log: str | None = None  # pytest's output, while it exists (`check` removes it; `labs check` may keep a copy)
    hints: str = DEFAULT_HINTS
    output: str = field(default="", repr=False)  # the log's text, read before its folder went (not in the JSON)
    duration_s: float = 0.0  # from reading the files to the last test
    sha256: dict = field(default_factory=dict)  # {file name: sha256 of the student's file}: what was graded
    commit: str = "unknown"  # the project's commit the checks came from: a regrade runs the same ones
    flags: list = field(default_factory=list)  # for the teacher, never the score: "copied-reference"
    warnings: list = field(default_factory=list)  # one line each, printed above the score

    @property
    def score(self) -> int:
        return sum(c.passed for c in self.checks)

    @property
    def total(self) -> int:
        return len(self.checks)

    @property
    def points(self) -> float:
        return _number(sum(c.points for c in self.checks))

    @property
    def max_points(self) -> int:
        return sum(c.max_points for c in self.checks)

    def as_dict(self) -> dict:
        passed = self.problem is None and self.score == self.total  # an unknown lab has 0 of 0 checks
        return dict(lab=self.lab, score=self.score, total=self.total, passed=passed,
                    points=self.points, max_points=self.max_points,
                    problem=self.problem, hints=self.hints, checks=[c.as_dict() for c in self.checks],
                    log=self.log, duration_s=round(self.duration_s, 2), sha256=self.sha256, commit=self.commit,
                    flags=self.flags, warnings=self.warnings)  # fmt: skip


def _number(x: float) -> float:
    """Points as a person writes them: 3, not 3.0; 1.33, not 1.3333333."""
    return int(round(x)) if abs(x - round(x)) < 1e-9 else round(x, 2)


def grade(lab: Lab, records: list[dict], summary: dict | None = None, checks: list[Check] | None = None,
          log: str | None = None, hints: str = DEFAULT_HINTS) -> Report:  # fmt: skip
    """Each check passes when every test it names ran and passed; a failed one says `hints` much. Its points:
    all or none, or, `partial`, a share for each test that passed (a family: every member passed)."""
    outcomes: dict[str, list[dict]] = {}
    for r in records:
        if "nodeid" in r:
            outcomes.setdefault(r["nodeid"], []).append(r)
    collect_errors = [r for r in records if "collect" in r]
    import_errors = [r for r in records if "import_error" in r]
    problem = None
    if import_errors:
        e = import_errors[0]
        problem = f"your {e['import_error']} does not import: {e['message']}"
    elif summary and summary.get("timed_out"):
        problem = f"the checks did not finish within the time limit ({summary['seconds']:.0f} s): an endless loop?"
    results = []
    for c in checks or lab.checks:
        ok, details, tests_passed = True, [], 0
        for spec in c.tests:
            runs = {nid: rs for nid, rs in outcomes.items() if matches(nid, spec)}
            if not runs:
                ok = False
                why = next((r["message"] for r in collect_errors if spec.startswith(r["collect"]) or not r["collect"]),
                           None) or (problem or "did not run")  # fmt: skip
                details.append(f"{spec.split('::')[-1]}: {why}")
                continue
            test_ok = True
            for nid, rs in runs.items():
                bad = [r for r in rs if r["outcome"] != "passed"]
                if bad:
                    ok = test_ok = False
                    r = bad[0]
                    where = "" if r["when"] == "call" else f" (in {r['when']})"
                    details.append(f"{nid.split('::')[-1]}{where}: {r['outcome']}: {r['message']}")
            tests_passed += test_ok
        points = c.points if ok else c.points * tests_passed / len(c.tests) if c.partial else 0
        results.append(CheckResult(c.id, c.title, ok, c.hint_at(hints), details, _number(points), c.points))
    return Report(lab.id, results, problem, log, hints)


def not_run(lab_id: str, problem: str, hints: str = DEFAULT_HINTS, paths: list[str | Path] = ()) -> Report:
    """The report when the checks could not run at all (a file that does not parse, a missing one, the
    runner failing, a refused file): every check of the lab failed with the reason, score 0, in the shape of any
    other; `paths`, the student's, for their sha256."""
    try:
        lab_checks = get(lab_id).checks
    except ValueError:  # no such lab: no checks to list
        lab_checks = ()
    results = [CheckResult(c.id, c.title, False, c.hint_at(hints), [f"not run: {problem}"], 0, c.points)
               for c in lab_checks]  # fmt: skip
    return Report(str(lab_id), results, problem, hints=hints, sha256=fingerprint(lab_id, paths),
                  commit=project_commit())  # fmt: skip


def student_files(lab_id: str, paths: list[str | Path]) -> list[tuple[str, Path]]:
    """(the lab's name for it, path) of each file the paths name: a folder's files named as the lab's, a file
    itself (named as the lab's one file, if the lab has one). Whether each is there is the caller's question;
    an unknown lab names no file, so only the files given are listed."""
    try:
        names = [m.filename for m in get(lab_id).modules]
    except ValueError:
        names = []
    out = []
    for p in map(Path, paths):
        p = p.expanduser()
        if p.is_dir():
            out += [(n, p / n) for n in names]
        else:
            out.append((names[0] if len(names) == 1 else p.name, p))
    return out


def fingerprint(lab_id: str, paths: list[str | Path]) -> dict[str, str]:
    """{file name: sha256} of the student's files that are there (any that can be found: for a report whose
    checks could not run, too), named as the lab names them."""
    found = {}
    for name, f in student_files(lab_id, paths):
        if f.is_file():
            found.setdefault(name, hashlib.sha256(f.read_bytes()).hexdigest())
    return found


def project_commit() -> str:
    """`git rev-parse HEAD` of the project, or "unknown" (no git, or not a checkout: an installed copy)."""
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def banner_hints(lab_id: str, paths: list[str | Path]) -> str:
    """The hints a failed check gives when the teacher asks for no level: as many as the student's starter
    gave (a guidance level and a hints level share their names: none, short, full), the least of the files'
    banners; DEFAULT_HINTS for files without one (or that cannot be read: the checks will say so)."""
    levels = []
    for _, f in student_files(lab_id, paths):
        try:
            level = guidance_of(f.read_text(errors="replace"))
        except OSError:
            continue
        if level is not None:
            levels.append(level)
    return min(levels, key=GUIDANCE.index) if levels else DEFAULT_HINTS


def check(lab: Lab, paths: list[str | Path], timeout: float = 900, hints: str | None = None) -> Report:
    """Everything `python -m labs check` does, but printing nothing and leaving nothing behind: the
    plan, the results and pytest's log live in a temporary folder removed before this returns (on an
    error or Ctrl-C too). The log's text stays in `report.output`; `report.log` is None. `hints` None: the
    starters' level (`banner_hints`). A file that uses the reference it replaces is refused: `LabsError`."""
    start = time.monotonic()
    swaps = resolve(lab, paths)
    refused = provenance.uses_of_the_reference(lab, swaps)
    if refused:
        raise LabsError(refused)
    copied = provenance.copied_parts(lab, swaps)
    copied = copied if provenance.is_a_copy(lab, copied) else []
    hints = hints or banner_hints(lab.id, paths)
    # ignore_cleanup_errors: after Ctrl-C a dying variant may still be writing; the interrupt matters more.
    with tempfile.TemporaryDirectory(prefix=f"labs-{lab.id}-", ignore_cleanup_errors=True) as work:
        workdir = Path(work)
        variant = check_variant(f"lab{lab.id}", lab, swaps, workdir, timeout=timeout)
        summary = run_plan([variant], workdir)[variant["name"]]
        report = grade(lab, read_results(variant["results"]), summary, hints=hints)
        report.output = Path(variant["log"]).read_text(errors="replace")
    report.duration_s = time.monotonic() - start
    report.sha256 = {m.filename: hashlib.sha256(Path(swaps[m.name]).read_bytes()).hexdigest() for m in lab.modules}
    report.commit = project_commit()
    if copied:
        report.flags.append("copied-reference")
        report.warnings.append(f"copied-reference: {', '.join(copied)} equal the reference's, once names, comments "
                               "and docstrings are set aside (scored as usual: the teacher decides)")  # fmt: skip
    return report
