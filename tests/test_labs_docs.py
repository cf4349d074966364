"""The labs' handouts and their index agree with the labs' definitions (marker `labs`, no engine).

Each handout (`docs/labs/<handout>`) ends with a note for teachers of one shape: the same four
headings in the same order (the time, what the checks catch, the planted bugs, the likely
mistakes), every check id and planted bug of the lab named in it, and the time it states equal to
the `minutes` of `labs/lab<id>.toml`. The handout's opening line says the same time, and the
index (`docs/labs/README.md`) lists each lab's checks and time as `python -m labs list` does. The
answer key (`docs/course/answer_keys.md`, the teacher's) has a section per lab, with an answer and a
rubric line for every numbered question of the handout's experiment. Reads text only: no torch, no
engine, well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from labs import spec

pytestmark = pytest.mark.labs

DOCS = Path(__file__).resolve().parent.parent / "docs" / "labs"
KEYS = DOCS.parent / "course" / "answer_keys.md"
HEADINGS = ("**Time**", "**What the checks catch**", "**Planted bugs**", "**Likely mistakes**")
# "Time: about 90 minutes, and 20 minutes for the experiment." in the opening, "**Time**: 90 minutes, ..." in the note
TIME = re.compile(r"Time\**: (?:about )?(\d+) minutes(?: \([^)]*\))?, and (\d+) minutes for the experiment")
LABS = spec.all_labs()


def teacher_note(lab: spec.Lab) -> str:
    text = (DOCS / lab.handout).read_text()
    assert "\n## For teachers\n" in text, f"{lab.handout} has no '## For teachers' section"
    return text.split("\n## For teachers\n", 1)[1].split("\n## ", 1)[0]


def stated_times(text: str, where: str) -> tuple[int, int]:
    m = TIME.search(text)
    assert m, f"{where} states no time as 'N minutes, and M minutes for the experiment'"
    return int(m[1]), int(m[2])


@pytest.mark.teacher
@pytest.mark.parametrize("lab", LABS, ids=lambda lab: lab.id)
def test_teacher_note_has_the_headings_in_order(lab):
    note = teacher_note(lab)
    at = [note.find(h) for h in HEADINGS]
    missing = [h for h, i in zip(HEADINGS, at) if i < 0]
    assert not missing, f"{lab.handout}'s teacher note lacks {missing}"
    assert at == sorted(at), f"{lab.handout}'s teacher note has its headings out of order: {HEADINGS}"


@pytest.mark.teacher
@pytest.mark.parametrize("lab", LABS, ids=lambda lab: lab.id)
def test_teacher_note_names_every_check_and_bug(lab):
    note = teacher_note(lab)
    catch = note.split("**What the checks catch**", 1)[-1].split("**Planted bugs**", 1)[0]
    bugs = note.split("**Planted bugs**", 1)[-1].split("**Likely mistakes**", 1)[0]
    unnamed = [c.id for c in lab.checks if f"`{c.id}`" not in catch]
    assert not unnamed, f"{lab.handout}: 'What the checks catch' says nothing of {unnamed}"
    unnamed = [b.name for b in lab.bugs if f"`{b.name}`" not in bugs]
    assert not unnamed, f"{lab.handout}: 'Planted bugs' does not name {unnamed}"
    for b in lab.bugs:  # each bug's line says which checks catch it, as its caught_by does
        line = next(ln for ln in bugs.splitlines() if f"`{b.name}`" in ln)
        entry = bugs[bugs.index(line) :].split("\n- ", 1)[0]
        missed = [c for c in b.caught_by if f"`{c}`" not in entry]
        assert not missed, f"{lab.handout}: bug {b.name}'s entry does not say it is caught by {missed}"


@pytest.mark.teacher
@pytest.mark.parametrize("lab", LABS, ids=lambda lab: lab.id)
def test_handout_times_match_the_definition(lab):
    text = (DOCS / lab.handout).read_text()
    opening = stated_times(text.split("\n## ", 1)[0], f"{lab.handout}'s opening")
    note = stated_times(teacher_note(lab), f"{lab.handout}'s teacher note")
    assert opening[0] == lab.minutes, (
        f"{lab.handout} opens with {opening[0]} minutes, lab{lab.id}.toml says {lab.minutes}"
    )
    assert note == opening, f"{lab.handout}: its teacher note says {note}, its opening {opening} (lab, experiment)"


def index_rows() -> dict[str, list[str]]:
    rows = {}
    for line in (DOCS / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 4 and cells[0] in spec.LAB_IDS:
            rows[cells[0]] = cells
    return rows


def test_index_lists_every_lab_with_its_checks_and_time():
    text = (DOCS / "README.md").read_text()
    header = next(ln for ln in text.splitlines() if ln.startswith("| lab |"))
    columns = [c.strip() for c in header.strip().strip("|").split("|")]
    rows = index_rows()
    assert sorted(rows) == sorted(spec.LAB_IDS)
    for lab in LABS:
        row = dict(zip(columns, rows[lab.id]))
        assert lab.handout in row["handout"], f"index row {lab.id} links {row['handout']}"
        assert int(row["checks"]) == len(lab.checks), (
            f"index: lab {lab.id} has {row['checks']} checks, spec {len(lab.checks)}"
        )
        time = next(v for k, v in row.items() if k.startswith("time"))
        m = re.fullmatch(r"(\d+) \+ (\d+) min", time)
        assert m, f"index: lab {lab.id}'s time {time!r} is not 'N + M min' (lab + experiment)"
        handout = stated_times((DOCS / lab.handout).read_text().split("\n## ", 1)[0], lab.handout)
        assert (int(m[1]), int(m[2])) == (lab.minutes, handout[1]), (
            f"index: lab {lab.id} takes {time}; lab{lab.id}.toml says {lab.minutes} minutes, the handout {handout}"
        )


def numbered(text: str) -> set[int]:
    """The numbers of a markdown text's top-level numbered items (`1. ...` at the start of a line)."""
    return {int(n) for n in re.findall(r"^(\d+)\. ", text, re.M)}


@pytest.mark.teacher
@pytest.mark.parametrize("lab", LABS, ids=lambda lab: lab.id)
def test_the_answer_key_answers_every_experiment_question(lab):
    sections = re.split(r"^## ", KEYS.read_text(), flags=re.M)
    section = next((s for s in sections if re.match(rf"Lab {re.escape(lab.id)} [—-]", s)), None)
    assert section is not None, f"{KEYS.name} has no section '## Lab {lab.id} — ...'"
    handout = (DOCS / lab.handout).read_text()
    experiment = handout.split("\n## The experiment", 1)[1].split("\n## ", 1)[0]
    questions = numbered(experiment)
    assert questions, f"{lab.handout}'s experiment asks no numbered question"
    missing = questions - numbered(section)
    assert not missing, f"the key to lab {lab.id} answers no question {sorted(missing)}"
    assert section.count("*Rubric:*") >= len(questions), f"the key to lab {lab.id}: a rubric line per question"
