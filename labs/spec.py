"""What a lab is made of: the module a student rewrites, the checks, the planted bugs, the experiment.

What it is: plain dataclasses, and `get(lab_id)`, which reads the lab's definition,
`labs/lab<id>.toml` (course content, not code: the functions a student writes and their
guiding comments, the checks and their hints, the planted bugs, the experiment; a teacher
edits it without touching Python), into them. Nothing here imports a level, so the command
line can describe a lab without loading the engine it is about to swap a piece of.

  - `Part`: one function or method the starter removes (`qualname`, as in
    `Scheduler.schedule`), with a guiding comment left in its place, as much of one as the
    teacher chooses (`GUIDANCE`, `python -m labs start --guidance`): the `goal` alone (what
    the function returns, its contract), the goal and a `nudge` (the one idea to reach for,
    never the code), or the full walk-through, `hint`; `keep_until` keeps the body up to
    and including a line (a kernel's prologue, say).
  - `Module`: a reference module (`level2_continuous.scheduler`) and its parts. The
    student's file for it is named like the reference (`scheduler.py`).
  - `Check`: what the student sees, one line each: a title, the tests behind it (pytest
    ids, from the level's own tests, the curriculum, or from `labs/lab<id>_checks.py`),
    and what a failure prints, at the teacher's choice of `HINTS` (`--hints`): the full
    hint (where to look, the usual mistake: close to the code to write), the rule (the
    property the failure breaks, and not how to keep it), or nothing; and its `points` in the
    grade (with `partial`, a share per test passed: labs/classroom.py grades a class).
  - `Bug`: a planted bug, made from the reference source by one string replacement; the
    checks it fails, exactly (tests/test_labs.py plants each one); and its cause, a phrase in
    the student's terms, with the words the full hint of each of those checks must contain
    (tests/test_labs_hints.py): a failure points at the mistake that made it.
  - `Experiment`: the command of the handout's experiment, and the small arguments the
    tests append to run it in seconds.

What it is not: the checks' code (`labs/lab<id>_checks.py`) or the grading
(`labs/grading.py`).

Reference: minitorch's per-task test markers; CS336's assignment adapters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
LAB_IDS = ["0", "0b", "0c", "0d", "1", "1b", "1c", "1d", "2", "2b", "2c", "3", "3b", "3c", "4", "4b", "5", "5b", "5c", "6", "6b", "6c", "6d"]
HINTS = ("full", "short", "none")  # how much a failed check says (`python -m labs check --hints`)
# The rule, not the code: a student who is handed the lines to write passes without reading the
# reference (one did a lab, 11/11, in ten minutes). `--hints full` is one flag away when stuck.
DEFAULT_HINTS = "short"
GUIDANCE = ("none", "short", "full")  # how much a starter's TODO says (`python -m labs start --guidance`), least first
# none: the goal (the contract); short: the goal and a nudge (the idea, not the code); full: the walk-through. The
# walk-through gives the lab away (lab 1b, "about 3 hours", was passed in 22 s from it), and the goal alone leaves
# a student with no way in where the docs do not already say how; the nudge sends them to the reference's docs
# and the idea, which is the lab. A starter's banner names its level, and `check` hints no more than it by default.
DEFAULT_GUIDANCE = "short"


@dataclass(frozen=True)
class Part:
    qualname: str  # "causal_attention", "Scheduler.schedule"
    hint: str  # --guidance full: the walk-through, several lines, close to the code
    goal: str  # --guidance none: what it returns or must achieve (its contract), one or two lines, no method
    nudge: str  # --guidance short (after the goal): the one idea to reach for, 1-3 lines, never the code
    keep_until: str | None = None  # keep the body up to and including the line that contains this

    def guidance(self, level: str) -> str:
        """The starter's comment for this part under `--guidance level`."""
        return {"none": self.goal, "short": f"{self.goal.strip()}\n{self.nudge.strip()}", "full": self.hint}[level]


@dataclass(frozen=True)
class Module:
    name: str  # the dotted reference module, e.g. "level2_continuous.scheduler"
    parts: tuple[Part, ...]

    @property
    def filename(self) -> str:
        return self.name.rsplit(".", 1)[1] + ".py"

    @property
    def reference_path(self) -> Path:
        return REPO / (self.name.replace(".", "/") + ".py")


@dataclass(frozen=True)
class Check:
    id: str  # short and stable: what --json and the tests refer to
    title: str  # what is checked, in the student's words
    tests: tuple[str, ...]  # pytest ids relative to the repository (a family or a file also works)
    hint: str  # --hints full: where to look, the usual mistake
    rule: str  # --hints short: the rule a failure breaks (an invariant, a property), never the code to write
    points: int  # its weight in the grade (`python -m labs grade`), given for every check: the rubric is the teacher's
    partial: bool = False  # several tests: a share of the points per test passed, rather than all or nothing

    def hint_at(self, level: str) -> str | None:
        """What a failure of this check says under `--hints level`."""
        return {"full": self.hint, "short": self.rule, "none": None}[level]


@dataclass(frozen=True)
class Bug:
    name: str
    module: str  # dotted module name
    old: str  # must occur exactly once in the reference source
    new: str
    caught_by: tuple[str, ...]  # the check ids that fail with it planted: exactly those (tests/test_labs.py)
    cause: str  # what is wrong, in the student's terms ("the running max changed but acc was not rescaled")
    cause_words: tuple[str, ...]  # 1-3 words in the full hint of every check in caught_by (test_labs_hints.py)


@dataclass(frozen=True)
class Experiment:
    module: str  # run as python -m <module> under the swap
    args: tuple[str, ...] = ()  # the handout's arguments
    smoke_args: tuple[str, ...] = ()  # appended by the tests: the same run, in seconds


@dataclass(frozen=True)
class Lab:
    id: str
    topic: str
    handout: str  # docs/labs/<file>
    modules: tuple[Module, ...]
    checks: tuple[Check, ...]
    bugs: tuple[Bug, ...]
    experiment: Experiment | None
    minutes: int = 90  # the time a student needs, for the teacher's note
    notes: dict = field(default_factory=dict)

    def module_for_file(self, filename: str) -> Module | None:
        return next((m for m in self.modules if m.filename == filename), None)

    def check(self, check_id: str) -> Check:
        return next(c for c in self.checks if c.id == check_id)


def get(lab_id: str) -> Lab:
    lab_id = str(lab_id).lower()
    if lab_id not in LAB_IDS:
        raise ValueError(f"there is no lab {lab_id!r}; the labs are {', '.join(LAB_IDS)}")
    return load(REPO / "labs" / f"lab{lab_id}.toml")


def load(path: Path) -> Lab:
    """A lab's definition file -> its Lab (a missing key is a KeyError naming it)."""
    d = tomllib.loads(Path(path).read_text())
    modules = tuple(Module(m["name"], tuple(Part(p["qualname"], p["hint"], p["goal"], p["nudge"], p.get("keep_until"))
                                            for p in m["parts"])) for m in d["modules"])  # fmt: skip
    checks = tuple(Check(c["id"], c["title"], tuple(c["tests"]), c["hint"], c["rule"], c["points"],
                         c.get("partial", False)) for c in d["checks"])  # fmt: skip
    bugs = tuple(Bug(b["name"], b["module"], b["old"], b["new"], tuple(b["caught_by"]), b["cause"],
                     tuple(b["cause_words"])) for b in d.get("bugs", ()))  # fmt: skip
    e = d.get("experiment")
    experiment = None if e is None else Experiment(e["module"], tuple(e["args"]), tuple(e["smoke_args"]))
    return Lab(d["id"], d["topic"], d["handout"], modules, checks, bugs, experiment, d["minutes"])


def all_labs() -> list[Lab]:
    return [get(i) for i in LAB_IDS]
