"""Grading a class: every student's folder checked, one CSV row each, and a Gradescope results.json each.

What it is: `grade(lab, submissions, out)`, behind `python -m labs grade N SUBMISSIONS/ --out grades.csv`.
SUBMISSIONS holds one folder per student, named by the student's id (folders whose names start
with `.` or `_` are skipped). Each folder is checked exactly as `python -m labs check N FOLDER
--json` checks it, in a subprocess of its own with a time limit, `jobs` at a time (default: the
cores, at most the students), so a crash, an endless loop or a file that does not parse is that
student's row, with 0 points and the reason in `problem`, and never the grader's end. Written:

  - the CSV (`out`), a row per student, sorted by id: `student`, the points of each check (a
    column per check id, the lab's rubric: `points` in labs/lab<id>.toml), `total`, `max`,
    `duration_s`, `sha256` (of each submitted file, in the lab's order of files), `commit` (the
    project's: a regrade at the same commit runs the same checks), `flags` (`copied-reference`:
    labs/provenance.py; `same-files-as:<ids>`: two students handed in identical files) and
    `problem` (why the checks could not run, or what stopped them);
  - beside it, in the folder named like the CSV without its suffix (grades.csv: grades/), each
    student's `<student>/results.json` in Gradescope's autograder format ({score, max_score,
    execution_time, output, tests: [{name, score, max_score, output}]}) and `<student>/check.log`
    (the report, then pytest's output).

A check that runs out of `timeout` inside the runner keeps the points of the checks that passed
before it was stopped (they did pass) and says so in `problem`; one that outlives `timeout` plus
a grace period (the grader's own limit: a check that hangs before its tests start) is stopped, 0.

What it is not: a sandbox (a student's code runs with the grader's rights: grade a class you do
not trust in a container), a detector of copying between students beyond identical files (MOSS
and JPlag compare structure), or Gradescope's harness: its `run_autograder` would run
`python -m labs check N /autograder/submission --json` and turn the report into results.json with
`results_json`.

Reference: Gradescope's autograder specifications (the results.json format); nbgrader's
`autograde` and its grade export (points per student and per test).
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from . import grading
from .grading import LabsError
from .spec import REPO, Lab

GRACE = 120.0  # seconds past the checks' own timeout before the grader stops a student's check itself
STOP_WAIT = 15.0  # after Ctrl-C, how long a check has to take its runner's processes down before SIGKILL


def columns(lab: Lab) -> list[str]:
    return ["student", *(c.id for c in lab.checks), "total", "max", "duration_s", "sha256", "commit", "flags",
            "problem"]  # fmt: skip


def grade(lab: Lab, submissions: Path, out: Path, jobs: int | None = None, timeout: float = 900,
          hints: str | None = None, echo=print) -> list[dict]:  # fmt: skip
    """Check every student's folder, write the CSV and each results.json and log; the CSV's rows, as dicts."""
    submissions, out = Path(submissions).expanduser(), Path(out).expanduser()
    if not submissions.is_dir():
        raise LabsError(f"{submissions}: no such directory (one folder per student goes there)")
    students = sorted(d for d in submissions.iterdir() if d.is_dir() and not d.name.startswith((".", "_")))
    if not students:
        raise LabsError(f"{submissions} has no student folders (one per student, named by the student's id)")
    results = results_dir(out)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(students)))
    commit = grading.project_commit()
    running = _Running()
    echo(f"lab {lab.id}: {len(students)} students, {jobs} at a time, {timeout:.0f} s each at most")
    rows = []
    pool = ThreadPoolExecutor(jobs)
    try:
        futures = [pool.submit(grade_one, lab, d, results / d.name, timeout, hints, running) for d in students]
        for f in as_completed(futures):
            report, seconds = f.result()
            row = csv_row(lab, report, seconds, commit)
            rows.append(row)
            echo(f"  {row['student']:<24} {row['total']:>6} of {row['max']}  {seconds:6.1f} s  "
                 f"{row['flags']} {row['problem']}".rstrip())  # fmt: skip
    except BaseException:  # Ctrl-C: the checks run in sessions of their own, which the terminal's SIGINT misses
        pool.shutdown(wait=False, cancel_futures=True)
        running.stop_all()
        raise
    pool.shutdown()
    rows.sort(key=lambda r: r["student"])
    _flag_identical(rows)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns(lab))
        writer.writeheader()
        writer.writerows(rows)
    echo(f"{out}: {len(rows)} rows; each student's results.json and check.log in {results}/")
    return rows


def results_dir(out: Path) -> Path:
    """Where each student's results.json and log go: beside the CSV, named like it (grades.csv: grades/)."""
    return out.with_suffix("") if out.suffix else out.with_name(out.name + "-results")


def grade_one(lab: Lab, folder: Path, out_dir: Path, timeout: float = 900, hints: str | None = None,
              running: _Running | None = None) -> tuple[dict, float]:  # fmt: skip
    """One student: `python -m labs check --json` on the folder, in a session of its own; its report (the
    student's `student` added) and the seconds it took. Writes out_dir/results.json and out_dir/check.log."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir / "check.log"
    log.unlink(missing_ok=True)  # an earlier grading's
    folder = folder.resolve()
    cmd = [sys.executable, "-m", "labs", "check", lab.id, str(folder), "--json", "--timeout", f"{timeout:g}",
           "--log", str(log), *(["--hints", hints] if hints else [])]  # fmt: skip
    start = time.monotonic()
    # cwd: the repository, so `-m labs` is ours even where the teacher's folder holds a `labs/` of its own
    proc = subprocess.Popen(cmd, cwd=REPO, env=grading.subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    if running is not None:
        running.add(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout + GRACE)
        stopped = False
    except subprocess.TimeoutExpired:
        stdout, stderr = _stop(proc)
        stopped = True
    finally:
        if running is not None:
            running.discard(proc)
    seconds = time.monotonic() - start
    report = _parse(stdout)
    if stopped:
        report = _failed(lab, folder, f"timed out: the check ran past {timeout + GRACE:.0f} s and was stopped")
    elif report is None:
        last = (stderr.strip().splitlines() or ["(nothing on stderr)"])[-1]
        report = _failed(lab, folder, f"the check crashed (exit {proc.returncode}): {last}")
    report["student"] = folder.name
    here = f"{folder}{os.sep}"  # a path in the student's folder, as the sheet and the student need it: the file's name
    report["problem"] = report["problem"] and report["problem"].replace(here, "")
    for c in report["checks"]:
        c["details"] = [d.replace(here, "") for d in c["details"]]
    (out_dir / "results.json").write_text(json.dumps(results_json(report, seconds), indent=1) + "\n")
    pytest_output = log.read_text(errors="replace") if log.is_file() else ""
    log.write_text(summary(report, seconds, cmd) + "\n--- pytest's output ---\n" + pytest_output
                   + (f"\n--- stderr ---\n{stderr}" if stderr.strip() else ""))  # fmt: skip
    return report, seconds


def _parse(stdout: str) -> dict | None:
    try:
        report = json.loads(stdout)
    except json.JSONDecodeError:
        return None
    return report if isinstance(report, dict) and "checks" in report else None


def _failed(lab: Lab, folder: Path, problem: str) -> dict:
    return grading.not_run(lab.id, problem, paths=[folder]).as_dict()


def _stop(proc: subprocess.Popen) -> tuple[str, str]:
    """Ctrl-C to the check's session first, so its runner takes the tests' process groups down with it
    (labs/runner.py does on KeyboardInterrupt); SIGKILL if it is still there STOP_WAIT seconds later."""
    for sig, wait in ((signal.SIGINT, STOP_WAIT), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            return proc.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return "", ""  # not reached: communicate() without a timeout returns once SIGKILL took it


class _Running:
    """The checks under way, for Ctrl-C (each runs in a session of its own, so the terminal's SIGINT misses it)."""

    def __init__(self):
        self.procs: set[subprocess.Popen] = set()
        self.lock = threading.Lock()

    def add(self, proc):
        with self.lock:
            self.procs.add(proc)

    def discard(self, proc):
        with self.lock:
            self.procs.discard(proc)

    def stop_all(self):
        with self.lock:
            procs = list(self.procs)
        for proc in procs:
            _stop(proc)


def csv_row(lab: Lab, report: dict, seconds: float, commit: str) -> dict:
    points = {c["id"]: c["points"] for c in report["checks"]}
    sha = report.get("sha256") or {}
    return {"student": report["student"], **{c.id: points.get(c.id, 0) for c in lab.checks},
            "total": report["points"], "max": sum(c.points for c in lab.checks), "duration_s": round(seconds, 1),
            "sha256": " ".join(sha[m.filename] for m in lab.modules if m.filename in sha), "commit": commit,
            "flags": " ".join(report.get("flags") or []), "problem": report.get("problem") or ""}  # fmt: skip


def _flag_identical(rows: list[dict]) -> None:
    """`same-files-as:<ids>` on each row whose files are byte for byte another student's."""
    by_hash: dict[str, list[str]] = {}
    for r in rows:
        if r["sha256"]:
            by_hash.setdefault(r["sha256"], []).append(r["student"])
    for r in rows:
        others = [s for s in by_hash.get(r["sha256"], []) if s != r["student"]]
        if others:
            r["flags"] = " ".join(filter(None, [r["flags"], "same-files-as:" + "+".join(others)]))


def results_json(report: dict, seconds: float) -> dict:
    """A `check --json` report in Gradescope's autograder format: one test per check, its points and, when it
    failed, what the report says of it (the hint at the report's level, then what failed)."""
    tests = [dict(name=f"{c['id']}: {c['title']}", score=c["points"], max_score=c["max_points"],
                  output="" if c["passed"] else "\n".join(filter(None, [c.get("hint"), *c["details"][:3]])))
             for c in report["checks"]]  # fmt: skip
    output = "\n".join(filter(None, [report.get("problem"), *(report.get("warnings") or [])]))
    return dict(score=report["points"], max_score=report["max_points"], execution_time=round(seconds, 1),
                output=output, tests=tests)  # fmt: skip


def summary(report: dict, seconds: float, cmd: list[str]) -> str:
    """The report as the log's first lines: what ran, the points, each check, what went wrong."""
    lines = [f"student {report['student']}, lab {report['lab']}: {report['points']} of {report['max_points']} "
             f"points, {report['score']}/{report['total']} checks, {seconds:.1f} s",
             "command: " + " ".join(cmd)]  # fmt: skip
    lines += [f"!! {report['problem']}"] if report.get("problem") else []
    lines += [f"warning: {w}" for w in report.get("warnings") or []]
    for c in report["checks"]:
        lines.append(f"  {'PASS' if c['passed'] else 'FAIL'}  {c['id']}  {c['points']}/{c['max_points']}  {c['title']}")
        lines += [f"        - {d}" for d in ([] if c["passed"] else c["details"][:3])]
    return "\n".join(lines) + "\n"
