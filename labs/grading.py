"""Grading: turn a lab and a student's files into a plan, run it, and read the checks back.

What it is: the part `python -m labs check` and tests/test_labs.py share.

  - `resolve(lab, paths)`: the student's files (a directory, or files named like the
    reference modules) -> `{module: absolute path}`, with a clear error for a missing or
    misnamed file and for one that does not parse (the line and the message, before any
    engine starts).
  - `check_variant(...)`: one plan variant, the lab's checks under the student's swaps.
  - `run_plan(variants)`: `python -m labs.runner plan` in a subprocess; returns when all
    variants have run.
  - `grade(lab, results)`: each check passed or not, with its hint and the first failure
    message, and the score: the JSON `--json` prints.

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
from .spec import REPO, Check, Lab


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
        raise LabsError(f"lab {lab.id} needs {', '.join(missing)} too (copy the starters with "
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
                  timeout: float = 900, no_shrink: bool = False) -> dict:  # fmt: skip
    """`no_shrink`: hypothesis reports a failure without minimising it (for runs expected to fail)."""
    tests = list(dict.fromkeys(t for c in (checks or lab.checks) for t in c.tests))
    safe = name.replace("/", "_")
    return dict(name=name, kind="pytest", swaps=swaps, tests=tests, timeout=timeout, no_shrink=no_shrink,
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
    """Run the variants in one warm `python -m labs.runner plan` process; {name: summary}."""
    plan = dict(variants=variants, jobs=jobs, summary=str(workdir / "summary.json"))
    path = workdir / "plan.json"
    path.write_text(json.dumps(plan, indent=1))
    proc = subprocess.run([sys.executable, "-m", "labs.runner", "plan", str(path)], cwd=REPO, env=subprocess_env(),
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
    hint: str
    details: list[str] = field(default_factory=list)  # what failed, one line per test

    def as_dict(self) -> dict:
        return dict(id=self.id, title=self.title, passed=self.passed, hint=None if self.passed else self.hint,
                    details=self.details)  # fmt: skip


@dataclass
class Report:
    lab: str
    checks: list[CheckResult]
    problem: str | None = None  # the student's file did not import, or the run timed out
    log: str | None = None

    @property
    def score(self) -> int:
        return sum(c.passed for c in self.checks)

    @property
    def total(self) -> int:
        return len(self.checks)

    def as_dict(self) -> dict:
        return dict(lab=self.lab, score=self.score, total=self.total, passed=self.score == self.total,
                    problem=self.problem, checks=[c.as_dict() for c in self.checks], log=self.log)  # fmt: skip


def grade(lab: Lab, records: list[dict], summary: dict | None = None, checks: list[Check] | None = None,
          log: str | None = None) -> Report:  # fmt: skip
    """Each check passes when every test it names ran and passed."""
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
        results.append(CheckResult(c.id, c.title, ok, c.hint, details))
    return Report(lab.id, results, problem, log)


def check(lab: Lab, paths: list[str | Path], timeout: float = 900) -> Report:
    """Everything `python -m labs check` does, but printing nothing."""
    swaps = resolve(lab, paths)
    workdir = Path(tempfile.mkdtemp(prefix=f"labs-{lab.id}-"))
    variant = check_variant(f"lab{lab.id}", lab, swaps, workdir, timeout=timeout)
    summary = run_plan([variant], workdir)[variant["name"]]
    return grade(lab, read_results(variant["results"]), summary, log=variant["log"])
