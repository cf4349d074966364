"""How much a starter says (`python -m labs start --guidance none|short|full`), and `check` following it.

What it is (marker `labs`, and quick: no engine starts):
  - every part of every lab has a goal and a nudge, short ones, none of them its hint, and a lab whose
    part lacks either does not load;
  - every lab's starter at each level is made, parses, names its level in its banner, and raises
    NotImplementedError in each part; the levels differ in comments only (the same code, compared
    as ASTs), so tests/test_labs.py's run of each lab's default starter ("an untouched starter fails
    every check") speaks for all three;
  - the `none` and `short` starters give nothing away: no line of a part's reference body and no line
    of its hint is in the comment that replaces it;
  - the banner's level is `check`'s default `--hints`; an explicit `--hints` wins; a file without the
    banner gets today's default.

What it is not: a run of the checks (tests/test_labs.py runs every starter's).
"""

from __future__ import annotations

import ast
import json
import re

import pytest

from labs import cli, grading, spec
from labs.spec import DEFAULT_GUIDANCE, DEFAULT_HINTS, GUIDANCE, all_labs, get
from labs.starters import _find, guidance_of, starter_files

pytestmark = pytest.mark.labs

LABS = all_labs()
LAB_IDS = [lab.id for lab in LABS]


def norm(line: str) -> str:
    return " ".join(line.split())


def todo_comments(lab, text: str) -> dict[str, str]:
    """{part's qualname: the text of the comment that replaces its body}, normalised."""
    out = {}
    for m in re.finditer(rf"^( *)# TODO \(lab {re.escape(lab.id)}\): (\S+)\n(.*?)^ *raise NotImplementedError",
                         text, re.S | re.M):  # fmt: skip
        lines = [line.strip().removeprefix("#") for line in m.group(3).splitlines()]
        out[m.group(2)] = norm(" ".join(lines))
    return out


def reference_body(module, part) -> list[str]:
    """The part's reference body (after the docstring), one normalised line each, its comments cut; the
    lines short enough to be common words (`return out`, `else:`) left out."""
    source = module.reference_path.read_text()
    fn = _find(ast.parse(source), part.qualname)
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    lines = source.splitlines()[body[0].lineno - 1 : fn.end_lineno] if body else []
    code = [norm(line.split("  #")[0]) for line in lines if not line.strip().startswith("#")]
    return [c for c in code if len(c) >= 16]


@pytest.mark.teacher
@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_every_part_has_a_short_goal_and_nudge(lab_id):
    for m in get(lab_id).modules:
        for p in m.parts:
            goal, nudge = p.goal.strip(), p.nudge.strip()
            assert goal and nudge, p.qualname
            assert len(goal.splitlines()) <= 2 and len(nudge.splitlines()) <= 3, p.qualname
            assert norm(goal) not in norm(p.hint) and norm(nudge) not in norm(p.hint), p.qualname
            assert p.guidance("none") == p.goal and p.guidance("full") == p.hint
            assert goal in p.guidance("short") and nudge in p.guidance("short")


@pytest.mark.parametrize("field", ["goal", "nudge"])
def test_a_part_without_a_goal_or_a_nudge_fails_the_lab(tmp_path, field):
    text = (spec.REPO / "labs" / "lab1.toml").read_text()
    cut, n = re.subn(rf'^{field} = (""".*?"""|"[^\n]*")\n', "", text, count=1, flags=re.S | re.M)
    assert n == 1
    broken = tmp_path / "lab1.toml"
    broken.write_text(cut)
    spec.load(spec.REPO / "labs" / "lab1.toml")  # the real one loads
    with pytest.raises(KeyError, match=field):
        spec.load(broken)


@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_every_starter_at_every_level_is_made_and_differs_in_comments_only(lab_id):
    lab = get(lab_id)
    made = {g: starter_files(lab, g) for g in GUIDANCE}
    assert made[DEFAULT_GUIDANCE] == starter_files(lab)  # the default: what tests/test_labs.py checks fail
    for g, files in made.items():
        for m in lab.modules:
            text = files[m.filename]
            assert guidance_of(text) == g and f"\n# guidance: {g}  " in text.split('"""')[0], text[:600]
            tree = ast.parse(text)
            for part in m.parts:
                fn = _find(tree, part.qualname)
                last = fn.body[-1]
                assert isinstance(last, ast.Raise) and f"lab {lab_id}: write {part.qualname}" in ast.unparse(last)
            comments = todo_comments(lab, text)
            assert sorted(comments) == sorted(p.qualname for p in m.parts)
            for part in m.parts:
                assert comments[part.qualname] == norm(" ".join(part.guidance(g).splitlines()))
            # the same code at every level: only the comments differ, so the checks fail alike
            assert ast.dump(tree) == ast.dump(ast.parse(made[DEFAULT_GUIDANCE][m.filename]))
    with pytest.raises(ValueError, match="guidance"):
        starter_files(lab, "most")


@pytest.mark.teacher
@pytest.mark.parametrize("guidance", ["none", "short"])
@pytest.mark.parametrize("lab_id", LAB_IDS)
def test_none_and_short_starters_give_no_code_away(lab_id, guidance):
    lab = get(lab_id)
    files = starter_files(lab, guidance)
    for m in lab.modules:
        comments = todo_comments(lab, files[m.filename])
        everything = " ".join(comments.values())
        for part in m.parts:
            for line in reference_body(m, part):
                assert line not in everything, (part.qualname, line)
            hint_lines = [norm(h) for h in part.hint.splitlines() if len(norm(h)) >= 24]
            for h in hint_lines:
                assert h not in everything, (part.qualname, h)


def json_check(capsys, *argv) -> tuple[int, dict]:
    code = cli.main(["check", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("guidance", GUIDANCE)
def test_the_starters_level_is_checks_default_hints(tmp_path, capsys, guidance):
    """A file that does not parse is reported without starting an engine, with every check's hint at the
    report's level: the banner's, unless `--hints` names one."""
    lab = get("2")
    assert cli.main(["start", "2", str(tmp_path / "mine"), "--guidance", guidance]) == 0
    capsys.readouterr()
    mine = tmp_path / "mine" / "scheduler.py"
    mine.write_text(mine.read_text() + "\ndef broken(:\n")
    for argv, level in [([str(mine)], guidance), ([str(tmp_path / "mine")], guidance),
                        ([str(mine), "--hints", "full"], "full"), ([str(mine), "--hints", "none"], "none")]:  # fmt: skip
        code, rep = json_check(capsys, "2", *argv)
        assert code == 2 and rep["hints"] == level, (argv, rep["hints"])
        for c in rep["checks"]:
            assert c["hint"] == lab.check(c["id"]).hint_at(level)
    assert grading.banner_hints("2", [mine]) == guidance
    capsys.readouterr()


def test_a_file_without_the_banner_gets_the_default_hints(tmp_path, capsys):
    lab = get("0")
    mine = tmp_path / "kv_cache.py"
    mine.write_text("def broken(:\n")
    code, rep = json_check(capsys, "0", str(mine))
    assert code == 2 and rep["hints"] == DEFAULT_HINTS
    assert grading.banner_hints("0", [tmp_path]) == DEFAULT_HINTS
    assert grading.banner_hints("nope", [tmp_path / "missing.py"]) == DEFAULT_HINTS
    # several files: the least revealing banner rules
    three = {g: tmp_path / g for g in GUIDANCE}
    for g, d in three.items():
        cli.main(["start", "0c", str(d), "--guidance", g])
    capsys.readouterr()
    mixed = [three["full"] / "sampler.py", three["short"] / "logits_processors.py"]
    assert grading.banner_hints("0c", mixed) == "short"
    assert {c["hint"] for c in json_check(capsys, "0", str(mine), "--hints", "none")[1]["checks"]} == {None}
    assert lab.checks


@pytest.mark.teacher
def test_start_and_starters_take_guidance(tmp_path, capsys):
    assert cli.main(["starters", "--lab", "4", "--guidance", "none"]) == 0
    printed = capsys.readouterr().out
    assert "# guidance: none" in printed and get("4").modules[0].parts[2].hint.splitlines()[1] not in printed
    assert cli.main(["starters", "--lab", "4", str(tmp_path / "all"), "--guidance", "full"]) == 0
    assert guidance_of((tmp_path / "all" / "lab4" / "rejection_sampler.py").read_text()) == "full"
    with pytest.raises(SystemExit):
        cli.parse(["start", "4", str(tmp_path), "--guidance", "most"])
    assert cli.parse(["start", "4", str(tmp_path)]).guidance == DEFAULT_GUIDANCE
    assert cli.parse(["check", "4", str(tmp_path)]).hints is None  # None: the banner's level (cmd_check)
