"""The classroom labs: every check can pass, every check can fail, and a planted bug fails the right one.

What it is (marker `labs`):
  - every lab's checks pass against the reference: the reference modules, copied out of
    the tree, are swapped in exactly as a student's files would be (every check runs on
    the copies; of a check's tests that the same pytest session also runs in the tree,
    only the first: `on_the_reference`);
  - every untouched starter, as `python -m labs start` writes it into the test's temporary
    folder, fails every check of its lab (lab 2's through the real command line,
    `python -m labs check 2 ... --json`, which leaves nothing in the temporary folder);
  - `--json` prints one JSON object whatever happens: a file that does not parse, a
    runner that crashes, Ctrl-C are a report with a `problem` and score 0;
  - each planted bug (labs/lab<id>.toml: one string replaced in the reference) fails exactly the
    checks it names (its `caught_by`; every check of its lab runs), and the failure prints the hint
    that points at it, as much of it as `--hints` asks for; every check has a short hint (its rule)
    that is not its full one;
  - the handouts' commands run: every `python -m labs ...` line of docs/labs/*.md parses,
    `start` writes the starters, `check` finds the files, and `experiment` runs (with the
    lab's small smoke arguments appended) on the reference;
  - no starter is committed, so the commands that make them are tested here: `start` writes
    the lab's starters made from today's reference (and refuses, without `--force`, to
    overwrite a file), `starters` prints every lab's (or `--lab`'s) or writes them to
    DIR/lab<id>/;
  - a process spawned by multiprocessing or started by subprocess imports the swapped file too.

Almost everything runs in one `python -m labs.runner plan` process: it imports torch,
transformers and pytest once and forks a child per variant (a starter, a bug, an
experiment), so the dozens of runs below cost seconds each, not a fresh interpreter each.

What it is not: a test of the levels (their own tests are the curriculum the checks reuse).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from labs import cli, grading
from labs.runner import matches
from labs.spec import HINTS, REPO, all_labs, get
from labs.starters import starter_files

pytestmark = pytest.mark.labs

LABS = all_labs()
LAB_IDS = [lab.id for lab in LABS]
BUGS = [(lab.id, bug.name) for lab in LABS for bug in lab.bugs]
HANDOUTS = REPO / "docs" / "labs"


def copy_reference(lab, into: Path) -> Path:
    """The reference modules of a lab, copied out of the tree: what a student who is done hands in."""
    into.mkdir(parents=True, exist_ok=True)
    for m in lab.modules:
        shutil.copyfile(m.reference_path, into / m.filename)
    return into


def handout_commands(lab) -> list[list[str]]:
    """Every `python -m labs ...` line of the lab's handout's ```bash blocks, as argv lists (comments cut)."""
    text = (HANDOUTS / lab.handout).read_text()
    lines = [line for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M) for line in block.splitlines()]
    return [shlex.split(line, comments=True)[3:] for line in lines if line.strip().startswith("python -m labs ")]


def run_in_the_tree(request) -> set[str]:
    """The tests this session runs in the tree (test_labs.py's aside), when it runs whole files: no
    `file::test` argument, `-k`, `-m` or other deselection, so a check's test named by its family or
    its file runs here in full or not at all. Otherwise none, and the reference runs every test."""
    session, config = request.session, request.config
    narrowed = any("::" in str(a) for a in config.args) or config.option.keyword or config.option.markexpr
    if narrowed or session.testscollected != len(session.items):
        return set()
    return {item.nodeid for item in session.items if not item.nodeid.startswith("tests/test_labs.py")}


def on_the_reference(check, in_session: set[str]):
    """What the reference's run needs of `check`: the tests this pytest session does not run in the tree
    anyway (the labs' own checks; all of them when this file runs alone), and always the check's first
    test, so that every check runs on the copied files. The rest would run the same code a second time:
    the copies are byte for byte the tree's files, and the session's own run of those tests fails if
    they do. (What this gives up: a later test of a check that would fail only on a copy, because it
    reads something beside the module's file; each check's first test runs on the copies.)"""
    rest = [t for t in check.tests[1:] if not any(matches(n, t) for n in in_session)]
    return dataclasses.replace(check, tests=(check.tests[0], *rest))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, request):
    """One plan, every variant: {name: (variant, summary)}, the reference copies per lab, and the checks
    the reference ran per lab (`on_the_reference`)."""
    work = tmp_path_factory.mktemp("labs-plan")
    refs = {lab.id: copy_reference(lab, work / "reference" / f"lab{lab.id}") for lab in LABS}
    variants = []
    everything = {m.name: str(refs[lab.id] / m.filename) for lab in LABS for m in lab.modules}
    in_tree = run_in_the_tree(request)
    reference = {lab.id: [on_the_reference(c, in_tree) for c in lab.checks] for lab in LABS}
    union = [c for lab in LABS for c in reference[lab.id]]
    variants.append(grading.check_variant("reference", LABS[0], everything, work, checks=union, timeout=600))
    for lab in LABS:
        if lab.id != "2":  # lab 2's starter goes through the real command line (test_the_command_line...)
            d = work / "starters" / f"lab{lab.id}"
            assert cli.main(["start", lab.id, str(d)]) == 0  # what a student starts from: made now, untouched
            swaps = {m.name: str(d / m.filename) for m in lab.modules}
            variants.append(
                grading.check_variant(f"starter-{lab.id}", lab, swaps, work, timeout=300, expect_failures=True)
            )
        for bug in lab.bugs:
            d = work / "bugs" / f"{lab.id}-{bug.name}"
            cli.main(["plant", lab.id, bug.name, str(d)])
            swaps = {m.name: str(d / m.filename) for m in lab.modules}
            # every check of the lab, not only caught_by: a bug must fail exactly the checks it names
            variant = grading.check_variant(
                f"bug-{lab.id}-{bug.name}", lab, swaps, work, None, 300, expect_failures=True
            )
            variants.append(variant)
        for i, argv in enumerate(handout_commands(lab)):
            args = cli.parse(argv)
            if args.command in ("experiment", "run"):
                module = lab.experiment.module if args.command == "experiment" else args.module
                assert module == lab.experiment.module, f"{lab.handout}: `run` only with the experiment's module"
                base = list(lab.experiment.args) if args.command == "experiment" else []
                swaps = grading.resolve(lab, [refs[lab.id]])
                argv = [*base, *args.args, *lab.experiment.smoke_args]
                variants.append(grading.module_variant(f"handout-{lab.id}-{i}", swaps, module, argv, work, timeout=300))
    probe = grading.module_variant("probe", {"level5_multigpu.layers": str(refs["5"] / "layers.py")}, "", [], work)
    variants.append({**probe, "kind": "probe", "module": "level5_multigpu.layers"})
    summary = grading.run_plan(variants, work, jobs=2)
    return {v["name"]: (v, summary[v["name"]]) for v in variants}, refs, reference


def report(runs, name, lab, checks=None, hints="full") -> grading.Report:
    variant, summary = runs[0][name]
    records = grading.read_results(variant["results"])
    return grading.grade(lab, records, summary, checks=checks, log=variant["log"], hints=hints)


def explain(rep: grading.Report) -> str:
    lines = [f"{c.id}: {'pass' if c.passed else 'FAIL'} {c.details}" for c in rep.checks]
    return "\n".join([f"problem: {rep.problem}", *lines, f"log: {rep.log}"])


@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_every_check_passes_on_the_reference(runs, lab_id):
    lab = get(lab_id)
    rep = report(runs, "reference", lab, checks=runs[2][lab_id])
    assert rep.score == rep.total == len(lab.checks), explain(rep)


@pytest.mark.parametrize("lab_id", [i for i in LAB_IDS if i != "2"])
def test_an_untouched_starter_fails_every_check(runs, lab_id):
    lab = get(lab_id)
    rep = report(runs, f"starter-{lab_id}", lab)
    assert rep.score == 0, explain(rep)
    assert any("NotImplementedError" in d for c in rep.checks for d in c.details), explain(rep)


def test_a_run_that_expects_failures_stops_each_check_at_its_first(runs):
    """A starter's or a planted bug's run only needs to know *that* each check fails: once every check a
    test belongs to has a failure, the test is skipped before its fixtures are built (a student's own
    check runs them all)."""
    skipped = 0
    for lab in LABS:
        names = [f"starter-{lab.id}"] * (lab.id != "2") + [f"bug-{lab.id}-{b.name}" for b in lab.bugs]
        for name in names:
            variant, _ = runs[0][name]
            failed, seen = set(), set()
            for r in grading.read_results(variant["results"]):
                if "nodeid" not in r or r["nodeid"] in seen or r["when"] == "teardown":
                    continue
                seen.add(r["nodeid"])
                mine = {
                    i for i, tests in enumerate(variant["stop_checks"]) if any(matches(r["nodeid"], t) for t in tests)
                }
                assert mine, f"{name}: {r['nodeid']} belongs to no check it runs"
                if mine <= failed:
                    assert r["outcome"] == "skipped" and "already failed" in r["message"], (name, r)
                    skipped += 1
                elif r["outcome"] == "failed":
                    failed |= mine
    assert skipped > 0, "no test was ever skipped: every check has one test, or the stop does not work"


REPORT_KEYS = {"lab", "score", "total", "passed", "problem", "hints", "checks", "log", "points", "max_points",
               "duration_s", "sha256", "commit", "flags", "warnings"}  # fmt: skip
CHECK_KEYS = {"id", "title", "passed", "hint", "details", "points", "max_points"}


def test_the_command_line_checks_lab_2s_starter_and_says_why(tmp_path):
    """`python -m labs check 2 <untouched starter> --json --hints short`, as an autograder runs it; the run
    leaves nothing in the temporary folder (its own, the runner's, pytest's tmp_path: all removed)."""
    mine, tmp = tmp_path / "lab2", tmp_path / "tmp"
    tmp.mkdir()
    assert cli.main(["start", "2", str(mine)]) == 0
    argv = [sys.executable, "-m", "labs", "check", "2", str(mine / "scheduler.py"), "--json", "--hints", "short"]
    proc = subprocess.run(argv, cwd=REPO, env=grading.subprocess_env({"TMPDIR": str(tmp)}), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    rep = json.loads(proc.stdout)
    assert set(rep) == REPORT_KEYS and rep["problem"] is None and rep["hints"] == "short"
    assert rep["lab"] == "2" and rep["score"] == 0 and rep["total"] == len(get("2").checks) and not rep["passed"]
    for c in rep["checks"]:
        assert set(c) == CHECK_KEYS and not c["passed"] and c["hint"] == get("2").check(c["id"]).rule, c
        assert any("NotImplementedError: lab 2: write Scheduler." in d for d in c["details"]), c
    assert sorted(p.name for p in tmp.iterdir()) == [], "a labs check left files in the temporary folder"


def broken_starter(tmp_path) -> Path:
    """Lab 2's starter with a syntax error on its last line."""
    assert cli.main(["start", "2", str(tmp_path / "lab2")]) == 0
    path = tmp_path / "lab2" / "scheduler.py"
    path.write_text(path.read_text() + "\ndef broken(:\n")
    return path


def json_check(capsys, *argv) -> tuple[int, dict]:
    """`python -m labs check ... --json` in this process: its exit code and the one JSON object it printed."""
    capsys.readouterr()
    code = cli.main(["check", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)  # json.loads refuses anything after the object


def test_json_reports_a_file_that_does_not_parse(tmp_path, capsys):
    path = broken_starter(tmp_path)
    line = len(path.read_text().splitlines())
    code, rep = json_check(capsys, "2", str(path))
    assert code == 2 and set(rep) == REPORT_KEYS and f"{path}:{line}:" in rep["problem"] and "parse" in rep["problem"]
    assert rep["score"] == 0 and rep["total"] == len(get("2").checks) and not rep["passed"]
    assert all(set(c) == CHECK_KEYS and not c["passed"] and rep["problem"] in c["details"][0] for c in rep["checks"])
    code, rep = json_check(capsys, "7", str(path))  # no such lab: still one object
    assert code == 2 and "there is no lab" in rep["problem"] and rep["checks"] == [] and not rep["passed"]


@pytest.mark.parametrize("argv", [["check", "2", "--json"], ["check", "2", "x.py", "--json", "--hints", "most"]],
                         ids=["no-path", "bad-hints"])  # fmt: skip
def test_json_reports_a_wrong_command_line_too(argv, capsys):
    from labs.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    rep = json.loads(out.out)  # one object on stdout; argparse's usage message stays on stderr
    assert e.value.code == 2 and set(rep) == REPORT_KEYS and rep["score"] == 0 and not rep["passed"]
    assert "command line is wrong" in rep["problem"] and "usage:" in out.err


@pytest.mark.parametrize("failure", [RuntimeError("the labs runner failed (exit 1):\nsome trace"), KeyboardInterrupt()])
def test_json_reports_a_run_that_broke_and_leaves_no_temporary_folder(tmp_path, capsys, monkeypatch, failure):
    def run_plan(variants, workdir, jobs=1):
        (workdir / "tmp").mkdir()  # what a run leaves in its folder
        raise failure

    monkeypatch.setattr(grading, "run_plan", run_plan)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    code, rep = json_check(capsys, "2", str(copy_reference(get("2"), tmp_path / "mine")))
    assert set(rep) == REPORT_KEYS and rep["score"] == 0 and not rep["passed"]
    if isinstance(failure, KeyboardInterrupt):
        assert code == 130 and "interrupted" in rep["problem"]
    else:
        assert code == 2 and rep["problem"].startswith("the checks could not run: RuntimeError: the labs runner")
        assert "some trace" not in rep["problem"]  # one line; the whole message went to stderr
    assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.parametrize("hints", HINTS)
def test_hints_say_as_much_as_asked(tmp_path, capsys, hints):
    """`--hints full|short|none`, in the JSON (here on a file that does not parse: no engine starts)."""
    code, rep = json_check(capsys, "2", str(broken_starter(tmp_path)), "--hints", hints)
    assert rep["hints"] == hints
    for c in rep["checks"]:
        check = get("2").check(c["id"])
        assert c["hint"] == {"full": check.hint, "short": check.rule, "none": None}[hints]


@pytest.mark.teacher
@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_every_check_has_a_rule_that_is_not_its_full_hint(lab_id):
    """The short hint names the rule a failure breaks, not the code to write: no calls, attributes, indexing."""
    for c in get(lab_id).checks:
        assert c.rule.strip() and c.hint.strip() and c.rule != c.hint and c.rule != c.title, c.id
        code = re.findall(r"\w\(|\w\.\w|\w\[|==|\+=", c.rule)
        assert not code, f"lab {lab_id}, {c.id}: the short hint reads like code ({code}): {c.rule}"


@pytest.mark.parametrize("lab_id,bug", BUGS)
def test_a_planted_bug_fails_its_checks_with_their_hints(runs, lab_id, bug, capsys):
    lab = get(lab_id)
    planted = next(b for b in lab.bugs if b.name == bug)
    checks = [lab.check(c) for c in planted.caught_by]
    rep = report(runs, f"bug-{lab_id}-{bug}", lab)  # every check of the lab ran
    assert rep.problem is None, explain(rep)
    # A check the bug does not break can still run out of time (CheckTimeout) on a busy machine: the bug made a
    # test slower (5c's fills-only-when-empty runs the pipeline one micro-batch at a time), or the machine is. That
    # is the clock's doing, not a failure the bug causes; every other failure must be in caught_by, and all of it.
    timed_out = {c.id for c in rep.checks if not c.passed and c.details and all("CheckTimeout" in d for d in c.details)}
    failed = [c.id for c in rep.checks if not c.passed and (c.id in planted.caught_by or c.id not in timed_out)]
    assert failed == list(planted.caught_by), (  # in the lab's order of checks, as caught_by lists them
        f"planted bug {bug} fails {failed}, its caught_by says {list(planted.caught_by)}: the hint of each check it "
        f"fails must name its cause (tests/test_labs_hints.py), so caught_by lists exactly those:\n{explain(rep)}"
    )
    for hints in HINTS:  # what the student sees at each level of --hints
        cli.print_report(report(runs, f"bug-{lab_id}-{bug}", lab, checks, hints=hints))
        printed = " ".join(capsys.readouterr().out.split())
        assert ("hint:" in printed) == (hints != "none"), printed
        for c in checks:
            full, rule = " ".join(c.hint.split())[:60], " ".join(c.rule.split())[:60]
            assert f"FAIL {c.id}" in printed
            assert (full in printed, rule in printed) == (hints == "full", hints == "short"), (hints, printed)


@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_the_handouts_commands_run(runs, lab_id, tmp_path):
    lab = get(lab_id)
    commands = handout_commands(lab)
    seen = {argv[0] for argv in commands}
    assert {"start", "check", "experiment"} <= seen, f"{lab.handout} must show start, check and experiment: {seen}"
    refs = runs[1]
    for i, argv in enumerate(commands):
        args = cli.parse(argv)
        assert args.lab == lab.id, f"{lab.handout}: {argv} is about lab {args.lab}"
        if args.command == "start":
            assert cli.main(["start", lab.id, str(tmp_path / "start")]) == 0
            for name, text in starter_files(lab).items():
                assert (tmp_path / "start" / name).read_text() == text
        elif args.command == "check":
            assert set(grading.resolve(lab, [refs[lab.id]])) == {m.name for m in lab.modules}
        elif args.command == "plant":
            assert cli.main(["plant", lab.id, args.bug, str(tmp_path / "plant")]) == 0
        else:
            variant, summary = runs[0][f"handout-{lab.id}-{i}"]
            out = Path(variant["log"]).read_text()
            assert summary["exit_code"] == 0 and not summary["timed_out"], f"{argv}: exit {summary}\n{out[-3000:]}"
            assert len(out.strip().splitlines()) >= 3, f"{argv} printed almost nothing:\n{out}"


@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_start_writes_the_starter_made_from_todays_reference(lab_id, tmp_path, capsys):
    """`python -m labs start N DIR`: each of the lab's modules, its parts emptied and the rest the reference's
    lines, made now (nothing is committed); it says where each came from, and never overwrites without --force."""
    lab, mine = get(lab_id), tmp_path / "mine"
    assert cli.main(["start", lab_id, str(mine)]) == 0
    out = capsys.readouterr().out.splitlines()
    made = starter_files(lab)
    assert sorted(p.name for p in mine.iterdir()) == sorted(made) == sorted(m.filename for m in lab.modules)
    for m in lab.modules:
        text, ref = (mine / m.filename).read_text(), m.reference_path.relative_to(REPO).as_posix()
        assert text == made[m.filename] and text.startswith(f"# Lab {lab_id}: your copy of {ref}.\n"), text[:300]
        assert f"{mine / m.filename}  <- your copy of {ref}" in out
        compile(text, m.filename, "exec")
        for part in m.parts:
            assert f'raise NotImplementedError("lab {lab_id}: write {part.qualname}")' in text, part.qualname
    assert out[-1] == f"next: fill in the TODOs, then  python -m labs check {lab_id} {mine}"
    first = mine / lab.modules[0].filename
    first.write_text("# my work\n")
    assert cli.main(["start", lab_id, str(mine)]) == 2
    assert "exists (your work?)" in capsys.readouterr().err and first.read_text() == "# my work\n"
    assert cli.main(["start", lab_id, str(mine), "--force"]) == 0 and first.read_text() == made[first.name]


def test_starters_prints_or_writes_every_labs_starter(tmp_path, capsys):
    """`python -m labs starters [--lab N] [DIR]`, for teachers: what `start` writes, for every lab (or one),
    printed each under a `==> lab<id>/<file> <==` line, or written to DIR/lab<id>/<file>."""
    made = {f"lab{lab.id}/{name}": text for lab in LABS for name, text in starter_files(lab).items()}
    assert cli.main(["starters"]) == 0
    printed = re.split(r"^==> (\S+) <==\n", capsys.readouterr().out, flags=re.M)
    assert printed[0] == "" and dict(zip(printed[1::2], printed[2::2])) == made
    assert cli.main(["starters", "--lab", "5c"]) == 0
    printed = re.split(r"^==> (\S+) <==\n", capsys.readouterr().out, flags=re.M)
    assert dict(zip(printed[1::2], printed[2::2])) == {k: v for k, v in made.items() if k.startswith("lab5c/")}
    assert cli.main(["starters", str(tmp_path / "all")]) == 0
    written = {p.relative_to(tmp_path / "all").as_posix(): p.read_text() for p in (tmp_path / "all").rglob("*.py")}
    assert written == made and capsys.readouterr().out.split() == [str(tmp_path / "all" / k) for k in made]
    assert cli.main(["starters", "--lab", "3", str(tmp_path / "one")]) == 0
    one = sorted(p.relative_to(tmp_path / "one").as_posix() for p in (tmp_path / "one").rglob("*"))
    assert one == ["lab3", *sorted(f"lab3/{m.filename}" for m in get("3").modules)]
    assert capsys.readouterr().out.split() == [str(tmp_path / "one" / "lab3" / m.filename) for m in get("3").modules]
    assert cli.main(["starters", str(tmp_path / "all")]) == 2  # files there: none overwritten without --force
    assert "use --force" in capsys.readouterr().err
    assert cli.main(["starters", "--lab", "7"]) == 2 and "there is no lab" in capsys.readouterr().err


def test_a_spawned_process_imports_the_swapped_file(runs):
    """Level 5's ranks are spawned by multiprocessing, a DP test's replicas started by subprocess: both
    must run the student's file too."""
    variant, summary = runs[0]["probe"]
    out, mine = Path(variant["log"]).read_text(), str(runs[1]["5"] / "layers.py")
    assert summary["exit_code"] == 0 and f"this process: {mine}" in out and f"a spawned process: {mine}" in out, out
    assert f"a started process: {mine}" in out, out


def test_bad_hand_ins_are_refused_in_one_line(tmp_path, capsys):
    assert cli.main(["check", "2", str(tmp_path / "nothing.py")]) == 2
    assert "no such file" in capsys.readouterr().err
    broken = tmp_path / "scheduler.py"
    broken.write_text("def schedule(:\n")
    assert cli.main(["check", "2", str(broken)]) == 2
    assert f"{broken}:1:" in capsys.readouterr().err
    assert cli.main(["check", "1", str(broken)]) == 2  # lab 1 has three files: a scheduler.py is none of them
    assert "name yours the same" in capsys.readouterr().err
    assert cli.main(["check", "7", str(broken)]) == 2
    assert "there is no lab" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # `run` without `-m MODULE`
        cli.main(["run", "2", str(broken)])
    assert "-m MODULE" in capsys.readouterr().err


def test_the_labs_index_commands_parse(capsys):
    text = (HANDOUTS / "README.md").read_text()
    lines = [line for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M) for line in block.splitlines()]
    argvs = [shlex.split(line, comments=True)[3:] for line in lines if line.strip().startswith("python -m labs ")]
    assert argvs and all(cli.parse(argv) for argv in argvs)
    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    for lab in LABS:
        assert f"lab {lab.id} " in listed and f"checks: {len(lab.checks)}" in listed and lab.handout in text


def test_experiment_and_run_take_each_file_of_a_two_file_lab():
    """`experiment 0c logits_processors.py sampler.py --seed 1`: the lab's files, then the experiment's own flags."""
    args = cli.parse(["experiment", "0c", "d/logits_processors.py", "d/sampler.py", "--seed", "1"])
    assert args.paths == ["d/logits_processors.py", "d/sampler.py"] and args.args == ["--seed", "1"]
    args = cli.parse(["run", "1b", "a/triton_attention.py", "a/attention_split.py", "-m", "pytest", "x.py"])
    assert args.paths == ["a/triton_attention.py", "a/attention_split.py"]
    assert (args.module, args.args) == ("pytest", ["x.py"])
    args = cli.parse(["experiment", "2", "d", "--watermarks", "0"])
    assert args.paths == ["d"] and args.args == ["--watermarks", "0"]


def test_experiment_swaps_in_both_files_of_a_two_file_lab(tmp_path, capsys, monkeypatch):
    """The command, not only its parse: both of the student's files swapped in, the flags to the experiment."""
    assert cli.main(["start", "0c", str(tmp_path)]) == 0
    started = []
    monkeypatch.setattr(
        cli.subprocess, "run", lambda argv, env: started.append((argv, env)) or SimpleNamespace(returncode=0)
    )
    files = [str(tmp_path / "logits_processors.py"), str(tmp_path / "sampler.py")]
    assert cli.main(["experiment", "0c", *files, "--seed", "1"]) == 0
    (argv, env), = started
    assert argv[-2:] == ["--seed", "1"] and "labs.lab0c_experiment" in argv
    out = capsys.readouterr().out
    assert all(f in out for f in files), out


def test_a_test_stops_on_its_cpu_time_and_on_a_longer_wall_clock(tmp_path):
    """labs/runner.py's limits: an endless loop is stopped by the CPU time it burns (a busy machine does not
    stretch that), a test that hangs without computing by the wall clock, WALL_MARGIN times later."""
    from labs import runner

    (tmp_path / "test_limits.py").write_text(
        "import time\n\ndef test_spins():\n    while True:\n        pass\n\n"
        "def test_sleeps():\n    time.sleep(60)\n"
    )
    log = tmp_path / "results.jsonl"
    plugin = runner.recorder(["test_limits.py"], str(log), test_timeout=0.5)
    t0 = time.monotonic()
    argv = [str(tmp_path / "test_limits.py"), "--rootdir", str(tmp_path), "-c", os.devnull, "-q", "-p", "no:cacheprovider"]
    pytest.main([*argv, "-p", "no:xdist", "-p", "no:benchmark"], plugins=[plugin])
    took = time.monotonic() - t0
    calls = {r["nodeid"].split("::")[-1]: r for r in map(json.loads, log.read_text().splitlines()) if r.get("when") == "call"}
    assert calls["test_spins"]["outcome"] == "failed" and "CPU time" in calls["test_spins"]["message"], calls
    # the second test runs with AFTER_A_TIMEOUT's shorter limit (here still 0.5 s): stopped by the wall clock
    assert calls["test_sleeps"]["outcome"] == "failed" and "without using its CPU" in calls["test_sleeps"]["message"]
    assert took < 30, took  # 0.5 s of CPU and 2.5 s of wall clock, not the 60 s sleep


@pytest.mark.teacher
def test_run_swaps_the_file_into_any_module(tmp_path):
    """`python -m labs run LAB PATH -m MODULE ARGS`, end to end: here the module is pytest, on a planted bug."""
    cli.main(["plant", "4", "accept-reversed", str(tmp_path)])
    test = "tests/test_level4.py::test_vectorised_sampler_equals_the_loop"
    proc = subprocess.run([sys.executable, "-m", "labs", "run", "4", str(tmp_path), "-m", "pytest", test, "-q",
                           "-p", "no:cacheprovider"], cwd=REPO, env=grading.subprocess_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 1 and "1 failed" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert f"with {tmp_path / 'rejection_sampler.py'}" in proc.stdout
