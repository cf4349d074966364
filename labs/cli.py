"""`python -m labs`: start a lab, check it, run the experiment with your code in the engine.

    python -m labs list                               the labs, their checks and handouts
    python -m labs start 2 ~/labs/lab2                write lab 2's starter(s) there, made now from the reference
                                                      (--guidance none|short|full: how much each TODO says)
    python -m labs check 2 ~/labs/lab2/scheduler.py   run lab 2's checks on your file (--json for autograding,
                                                      --hints full|short|none: how much a failed check says;
                                                      by default as much as the starter's --guidance said)
    python -m labs experiment 2 ~/labs/lab2           the handout's experiment, with your code swapped in
    python -m labs run 2 ~/labs/lab2 -m level2_continuous.demo --requests 8
                                                      any module (a demo, a benchmark), with your code swapped in
    python -m labs plant 2 oldest-victim ~/bugs       the reference with a planted bug (for teachers)
    python -m labs starters [--lab 2] [DIR]           every lab's starter (--lab: one lab's), printed, or with DIR
                                                      written there as DIR/lab2/scheduler.py (for teachers)
    python -m labs grade 2 submissions/ --out grades.csv
                                                      every student's folder checked: a CSV of points, and a
                                                      Gradescope results.json and a log each (for teachers)
    python -m labs export-student ~/course --labs 2,4 the project as students get it, labs 2 and 4 emptied
                                                      (for teachers)

What it is: the command line over `labs.grading`, `labs.runner`, `labs.starters` and
`labs.classroom` (`grade`). No starter is kept in the repository: `start` and `starters`
make them from the reference as they run. Your file replaces the reference module under
the reference's name, in a subprocess, so the rest of the engine (the real one) runs your
piece; nothing you run here changes the repository.

`check --json` prints exactly one JSON object, whatever happens: when the checks cannot run
(a file that does not parse, a missing file, an unknown lab), it is the usual report with
score 0 and the reason in `problem`, so an autograder's `json.load` never fails.

What it is not: the checks (each lab's `labs/lab<id>.toml` lists them) or a sandbox.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
import traceback
from pathlib import Path

from . import grading, spec, student_edition, swap
from .grading import LabsError
from .spec import REPO
from .starters import make_starter

GUIDANCE_HELP = ("how much each TODO says: none (only the goal: what the function returns), short (the goal "
                 f"and the one idea to reach for), full (a walk-through, close to the code); default "
                 f"{spec.DEFAULT_GUIDANCE}")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the labs, their checks and handouts")
    s = sub.add_parser("start", help="write a lab's starter files, made from the reference, into a directory of yours")
    s.add_argument("lab", help="a lab's id, e.g. 2 or 0b (python -m labs list)")
    s.add_argument("dir", type=Path, help="where the starter files go (made if missing)")
    s.add_argument("--force", action="store_true", help="overwrite files already there")
    s.add_argument("--guidance", choices=spec.GUIDANCE, default=spec.DEFAULT_GUIDANCE, help=GUIDANCE_HELP)
    # allow_abbrev=False: `--js` must not pass for `--json`, which main() looks for to answer in JSON
    c = sub.add_parser("check", help="run a lab's checks on your file(s)", allow_abbrev=False)
    c.add_argument("lab", help="a lab's id, e.g. 2 or 0b (python -m labs list)")
    c.add_argument("paths", nargs="+", help="your file, or the directory holding your files")
    c.add_argument("--json", action="store_true", help="print only the JSON report: one object, whatever happens")
    c.add_argument("--timeout", type=float, default=900, help="seconds before the checks are stopped (default 900)")
    c.add_argument("--verbose", action="store_true", help="also print pytest's full output")
    c.add_argument("--log", type=Path, help="write pytest's output to this file (`grade` keeps one per student)")
    c.add_argument("--hints", choices=spec.HINTS, default=None,
                   help="what a failed check says: full (where to look, close to the code), short (the rule it "
                        "breaks), none (only that it failed); default: the level in your starter's banner "
                        f"(`# guidance: ...`), {spec.DEFAULT_HINTS} for a file without one")  # fmt: skip
    e = sub.add_parser("experiment", help="run the handout's experiment with your code swapped in")
    e.add_argument("lab", help="a lab's id, e.g. 2 or 0b (python -m labs list)")
    e.add_argument("path", help="your file, or the directory holding your files (a lab of two files: both, or the "
                                "directory)")  # fmt: skip
    e.add_argument("args", nargs=argparse.REMAINDER, help="more arguments for the experiment")
    r = sub.add_parser("run", help="run any module (python -m MODULE ARGS) with your code swapped in",
                       usage="python -m labs run LAB PATH -m MODULE [ARGS ...]")  # fmt: skip
    r.add_argument("lab", help="a lab's id, e.g. 2 or 0b (python -m labs list)")
    r.add_argument("path", help="your file, or the directory holding your files")
    r.add_argument("rest", nargs=argparse.REMAINDER, metavar="-m MODULE [ARGS ...]",
                   help="the module to run, e.g. -m level2_continuous.demo, then its arguments")  # fmt: skip
    b = sub.add_parser("plant", help="write the reference with one of a lab's planted bugs (for teachers)")
    b.add_argument("lab", help="a lab's id, e.g. 2 or 0b (python -m labs list)")
    b.add_argument("bug", help="a bug's name (python -m labs list shows them)")
    b.add_argument("dir", type=Path, help="where the planted reference goes")
    st = sub.add_parser("starters", help="every lab's starter as `start` makes it: printed, or written to DIR/lab<id>/")
    st.add_argument("dir", type=Path, nargs="?", help="write them here, one folder a lab (default: print them)")
    st.add_argument("--lab", help="only this lab's")
    st.add_argument("--force", action="store_true", help="overwrite files already in DIR")
    st.add_argument("--guidance", choices=spec.GUIDANCE, default=spec.DEFAULT_GUIDANCE, help=GUIDANCE_HELP)
    g = sub.add_parser("grade", help="check every student's folder: a CSV of points, a Gradescope results.json each "
                                     "(for teachers)")  # fmt: skip
    g.add_argument("lab", help="a lab's id, e.g. 2 or 0b (python -m labs list)")
    g.add_argument("submissions", type=Path, help="one folder per student, named by the student's id")
    g.add_argument("--out", type=Path, required=True,
                   help="the CSV to write; each student's results.json and check.log go to the folder named like "
                        "it (grades.csv: grades/<student>/)")  # fmt: skip
    g.add_argument("--jobs", type=int, help="students checked at once (default: the cores, at most the students)")
    g.add_argument("--timeout", type=float, default=900, help="seconds each student's checks may take (default 900)")
    g.add_argument("--hints", choices=spec.HINTS, help="what a failed check says in results.json (default: as check)")
    x = sub.add_parser("export-student", help="write the project as students get it to DEST (for teachers)")
    x.add_argument("dest", type=Path, help="where it goes")
    x.add_argument("--labs", help="the labs whose functions are emptied, e.g. 2,3b,4 (default: every lab)")
    x.add_argument("--force", action="store_true", help="overwrite what is in DEST already")
    x.add_argument("--guidance", choices=spec.GUIDANCE, default=spec.DEFAULT_GUIDANCE, help=GUIDANCE_HELP)
    return p


def parse(argv=None) -> argparse.Namespace:
    """The parser's namespace; for `run`, `-m MODULE` and the module's own arguments split off."""
    p = parser()
    args = p.parse_args(argv)
    if args.command in ("experiment", "run"):  # `experiment 0c logits_processors.py sampler.py --flag`: both yours
        rest = args.args if args.command == "experiment" else args.rest
        more = 0
        while more < len(rest) and rest[more].endswith(".py") and not rest[more].startswith("-"):
            more += 1
        args.paths, rest[:more] = [args.path, *rest[:more]], []
    if args.command == "run":
        if len(args.rest) < 2 or args.rest[0] != "-m":
            p.error("run: give the module to run after your path: python -m labs run LAB PATH -m MODULE [ARGS ...]")
        args.module, args.args = args.rest[1], args.rest[2:]
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parse(argv)
    except SystemExit as e:  # argparse's usage error: on stderr, and with check --json one JSON object too
        if e.code == 2 and argv[:1] == ["check"] and "--json" in argv:
            lab = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else "?"
            problem = "the command line is wrong (argparse's message is on stderr): " + " ".join(argv)
            print(json.dumps(grading.not_run(lab, problem).as_dict(), indent=1))
        raise
    try:
        return COMMANDS[args.command](args)
    except LabsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def cmd_list(args) -> int:
    for lab in spec.all_labs():
        files = ", ".join(m.filename for m in lab.modules)
        print(f"lab {lab.id:<3} {lab.topic}")
        print(f"        files: {files}   checks: {len(lab.checks)}   handout: docs/labs/{lab.handout}")
        if lab.bugs:
            print(f"        planted bugs: {', '.join(b.name for b in lab.bugs)}")
    return 0


def cmd_start(args) -> int:
    lab = _lab(args.lab)
    starters = _starters(lab, args.guidance)
    _write({args.dir / m.filename: text for m, text in starters}, args.force)
    for m, _ in starters:
        print(f"{args.dir / m.filename}  <- your copy of {m.reference_path.relative_to(REPO)}")
    print(f"next: fill in the TODOs, then  python -m labs check {lab.id} {args.dir}")
    return 0


def _starters(lab: spec.Lab, guidance: str = spec.DEFAULT_GUIDANCE) -> list[tuple[spec.Module, str]]:
    """Each module of the lab and its starter, made now from the reference."""
    try:
        return [(m, make_starter(lab, m, guidance)) for m in lab.modules]
    except ValueError as e:  # a level changed under the lab (a part renamed): say so, not a trace
        raise LabsError(f"lab {lab.id}'s starter cannot be made from today's reference: {e}") from None


def _write(files: dict[Path, str], force: bool) -> None:
    """Write every file, or, if one is there already and not `force`, none: a student's work is never lost."""
    for dst in files:
        if dst.exists() and not force:
            raise LabsError(f"{dst} exists (your work?); use --force to overwrite it")
    for dst, text in files.items():
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text)


def cmd_check(args) -> int:
    args.hints = args.hints or grading.banner_hints(args.lab, args.paths)  # not given: the starter's level
    if args.json:
        return check_json(args)
    lab = _lab(args.lab)
    swaps = grading.resolve(lab, args.paths)
    for module, path in swaps.items():
        print(f"lab {lab.id} ({lab.topic}): {path} replaces {module}")
    print(f"running {len(lab.checks)} checks...", flush=True)
    report = grading.check(lab, args.paths, timeout=args.timeout, hints=args.hints)
    if args.log:
        report.log = write_log(args.log, report.output)
    elif report.score < report.total and not args.verbose:
        report.log = keep_log(lab, report.output)
    print_report(report, verbose=args.verbose)
    return 0 if report.score == report.total else 1


def check_json(args) -> int:
    """`check --json`: one JSON object on stdout whatever happens. Exit 0 all passed, 1 some failed, 2 the
    checks could not run (as without --json), 130 interrupted; the reason is in `problem`, the trace on stderr."""
    start = time.monotonic()
    try:
        report = grading.check(_lab(args.lab), args.paths, timeout=args.timeout, hints=args.hints)
        code = 0 if report.score == report.total else 1
    except LabsError as e:  # what the student handed in (or a refused file): one line says it
        report, code = grading.not_run(args.lab, str(e), args.hints, paths=args.paths), 2
    except Exception as e:  # noqa: BLE001 - the runner failed: still a report, and the whole story on stderr
        traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0]
        report, code = grading.not_run(args.lab, f"the checks could not run: {type(e).__name__}: {first}",
                                       args.hints, paths=args.paths), 2  # fmt: skip
    except KeyboardInterrupt:
        report = grading.not_run(args.lab, "interrupted before the checks finished", args.hints, paths=args.paths)
        code = 130
    report.duration_s = report.duration_s or time.monotonic() - start
    if args.log:
        report.log = write_log(args.log, report.output or report.problem or "")
    print(json.dumps(report.as_dict(), indent=1))
    return code


def write_log(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def keep_log(lab: spec.Lab, text: str) -> str:
    """pytest's output of a check that failed, as one file that outlives the command: the report prints its
    path for the student to open. It goes where every output a run tells its user about goes (ladder's
    output folder, outside the repository), one file per lab that the next check replaces; everything else
    the check wrote is gone by now."""
    from ladder.cli import output_dir

    path = output_dir() / f"labs-{lab.id}-check.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def print_report(report: grading.Report, verbose: bool = False) -> None:
    if report.problem:
        print(f"\n  !! {report.problem}\n")
    width = max(len(c.id) for c in report.checks)
    for c in report.checks:
        print(f"  {'PASS' if c.passed else 'FAIL'}  {c.id:<{width}}  {c.points:>4}/{c.max_points:<2}  {c.title}")
        if not c.passed:
            for line in textwrap.wrap(
                c.hint or "", 100, initial_indent="hint: ", subsequent_indent="      ", break_on_hyphens=False
            ):
                print(f"        {line}")
            for d in c.details[:3]:  # the failing test's own message: what went wrong, at every level of hints
                print(f"        - {textwrap.shorten(d, 160)}")
    for w in report.warnings:
        print(f"  warning: {w}")
    print(f"score: {report.score}/{report.total} checks, {report.points}/{report.max_points} points")
    if verbose:
        print(report.output or (Path(report.log).read_text() if report.log else ""))
    elif report.log and report.score < report.total:
        print(f"pytest's full output: {report.log}")


def cmd_experiment(args) -> int:
    lab = _lab(args.lab)
    if lab.experiment is None:
        raise LabsError(f"lab {lab.id} has no experiment")
    return _run_module(lab, args.paths, lab.experiment.module, [*lab.experiment.args, *args.args])


def cmd_run(args) -> int:
    return _run_module(_lab(args.lab), args.paths, args.module, args.args)


def _run_module(lab: spec.Lab, paths: list[str], module: str, argv: list[str]) -> int:
    swaps = grading.resolve(lab, paths)
    env = swap.swapped_env(swaps, grading.subprocess_env())
    # The run's pictures and JSON (ladder.cli.output_dir) go to the student's folder, beside their code.
    folder = Path(paths[0]) if Path(paths[0]).is_dir() else Path(paths[0]).parent
    env["INFERENCE_LADDER_OUT"] = str(folder.resolve())
    print(f"(lab {lab.id}: running python -m {module} with {', '.join(swaps.values())})", flush=True)
    return subprocess.run([sys.executable, "-m", "labs.runner", "module", module, *argv], env=env).returncode


def cmd_plant(args) -> int:
    if student_edition.is_student_edition():
        raise LabsError(student_edition.PLANT_REFUSAL)
    lab = _lab(args.lab)
    bug = next((b for b in lab.bugs if b.name == args.bug), None)
    if bug is None:
        raise LabsError(f"lab {lab.id} has no planted bug {args.bug!r}: {', '.join(b.name for b in lab.bugs)}")
    args.dir.mkdir(parents=True, exist_ok=True)
    for m in lab.modules:
        text = m.reference_path.read_text()
        if m.name == bug.module:
            text = plant(bug, text)
        (args.dir / m.filename).write_text(text)
        print(args.dir / m.filename)
    return 0


def plant(bug: spec.Bug, source: str) -> str:
    """The reference source with the bug planted (the string must be there exactly once)."""
    n = source.count(bug.old)
    if n != 1:
        raise LabsError(
            f"planted bug {bug.name}: {bug.old!r} occurs {n} times in {bug.module} (the reference changed?)"
        )
    return source.replace(bug.old, bug.new)


def cmd_starters(args) -> int:
    """Every lab's starters (or `--lab`'s): printed one after another, each under a `==> lab<id>/<file> <==`
    line (as `head` prints several files), or written to DIR/lab<id>/<file>, a path printed for each."""
    labs = [_lab(args.lab)] if args.lab else spec.all_labs()
    files = {Path(f"lab{lab.id}") / m.filename: text for lab in labs for m, text in _starters(lab, args.guidance)}
    if args.dir is not None:
        _write({args.dir / rel: text for rel, text in files.items()}, args.force)
        print("\n".join(str(args.dir / rel) for rel in files))
        return 0
    for rel, text in files.items():
        print(f"==> {rel.as_posix()} <==")
        print(text, end="" if text.endswith("\n") else "\n")
    return 0


def cmd_grade(args) -> int:
    """Every student's folder checked (labs/classroom.py); 0 once the CSV is written, whatever the scores."""
    from .classroom import grade

    grade(_lab(args.lab), args.submissions, args.out, jobs=args.jobs, timeout=args.timeout, hints=args.hints)
    return 0


def cmd_export_student(args) -> int:
    try:  # imported here: the command line works without it
        from .student_edition import export_student
    except ModuleNotFoundError as e:
        if e.name != f"{__package__}.student_edition":
            raise
        raise LabsError("this copy of the labs has no student edition (labs/student_edition.py)") from None
    labs = [i.strip() for i in args.labs.split(",") if i.strip()] if args.labs else list(spec.LAB_IDS)
    export_student(args.dest, labs, args.force, guidance=args.guidance)
    return 0


def _lab(lab_id: str) -> spec.Lab:
    try:
        return spec.get(lab_id)
    except ValueError as e:
        raise LabsError(str(e)) from None


COMMANDS = dict(list=cmd_list, start=cmd_start, check=cmd_check, experiment=cmd_experiment, run=cmd_run,
                plant=cmd_plant, starters=cmd_starters, grade=cmd_grade)  # fmt: skip
COMMANDS["export-student"] = cmd_export_student
