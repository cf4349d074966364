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
  - `check(lab, paths)`: all of it, in a temporary folder that is gone when it returns.

What it is not: the checks themselves (the level's tests and `labs/lab<id>_checks.py`).

Reference: nbgrader's autograde output (one line per test, points, a total).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .runner import matches
from .spec import DEFAULT_HINTS, REPO, Check, Lab, get


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

    def as_dict(self) -> dict:
        return dict(id=self.id, title=self.title, passed=self.passed, hint=None if self.passed else self.hint,
                    details=self.details)  # fmt: skip


@dataclass
class Report:
    lab: str
    checks: list[CheckResult]
    problem: str | None = None  # the checks could not run, the student's file did not import, or the run timed out
    log: str | None = None  # pytest's output, while it exists (`check` removes it; `labs check` may keep a copy)
    hints: str = DEFAULT_HINTS
    output: str = field(default="", repr=False)  # the log's text, read before its folder went (not in the JSON)

    @property
    def score(self) -> int:
        return sum(c.passed for c in self.checks)

    @property
    def total(self) -> int:
        return len(self.checks)

    def as_dict(self) -> dict:
        passed = self.problem is None and self.score == self.total  # an unknown lab has 0 of 0 checks
        return dict(lab=self.lab, score=self.score, total=self.total, passed=passed,
                    problem=self.problem, hints=self.hints, checks=[c.as_dict() for c in self.checks],
                    log=self.log)  # fmt: skip


def grade(lab: Lab, records: list[dict], summary: dict | None = None, checks: list[Check] | None = None,
          log: str | None = None, hints: str = DEFAULT_HINTS) -> Report:  # fmt: skip
    """Each check passes when every test it names ran and passed; a failed one says `hints` much."""
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
        ok, details = True, []
        for spec in c.tests:
            runs = {nid: rs for nid, rs in outcomes.items() if matches(nid, spec)}
            if not runs:
                ok = False
                why = next((r["message"] for r in collect_errors if spec.startswith(r["collect"]) or not r["collect"]),
                           None) or (problem or "did not run")  # fmt: skip
                details.append(f"{spec.split('::')[-1]}: {why}")
                continue
            for nid, rs in runs.items():
                bad = [r for r in rs if r["outcome"] != "passed"]
                if bad:
                    ok = False
                    r = bad[0]
                    where = "" if r["when"] == "call" else f" (in {r['when']})"
                    details.append(f"{nid.split('::')[-1]}{where}: {r['outcome']}: {r['message']}")
        results.append(CheckResult(c.id, c.title, ok, c.hint_at(hints), details))
    return Report(lab.id, results, problem, log, hints)


def not_run(lab_id: str, problem: str, hints: str = DEFAULT_HINTS) -> Report:
    """The report when the checks could not run at all (a file that does not parse, a missing one, the
    runner failing): every check of the lab failed with the reason, score 0, in the shape of any other."""
    try:
        lab_checks = get(lab_id).checks
    except ValueError:  # no such lab: no checks to list
        lab_checks = ()
    results = [CheckResult(c.id, c.title, False, c.hint_at(hints), [f"not run: {problem}"]) for c in lab_checks]
    return Report(str(lab_id), results, problem, hints=hints)


def check(lab: Lab, paths: list[str | Path], timeout: float = 900, hints: str = DEFAULT_HINTS) -> Report:
    """Everything `python -m labs check` does, but printing nothing and leaving nothing behind: the
    plan, the results and pytest's log live in a temporary folder removed before this returns (on an
    error or Ctrl-C too). The log's text stays in `report.output`; `report.log` is None."""
    swaps = resolve(lab, paths)
    # ignore_cleanup_errors: after Ctrl-C a dying variant may still be writing; the interrupt matters more.
    with tempfile.TemporaryDirectory(prefix=f"labs-{lab.id}-", ignore_cleanup_errors=True) as work:
        workdir = Path(work)
        variant = check_variant(f"lab{lab.id}", lab, swaps, workdir, timeout=timeout)
        summary = run_plan([variant], workdir)[variant["name"]]
        report = grade(lab, read_results(variant["results"]), summary, hints=hints)
        report.output = Path(variant["log"]).read_text(errors="replace")
    return report
