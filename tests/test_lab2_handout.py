"""Lab 2's handout states every rule its checks test, where a student reads it: before the teachers' notes.

What it is: each check of labs/lab2.toml paired with the words of the handout's student part (its goals,
background, policy, task and check sections) that state that check's rule, so a check added without its rule
in the handout fails here, as `headroom` did (only the teachers' notes named it).

What it is not: a test of the checks themselves (tests/test_labs.py runs them against the reference and the
planted bugs).
"""

from __future__ import annotations

import pytest

from labs import spec
from ladder.models import REPO

pytestmark = pytest.mark.labs

RULES = {  # check id -> the words in the handout that state its rule
    "budget": "cut to what is left of the token budget",
    "seats": "seats (`max_num_seqs`)",
    "recompute": "Preemption is by\n   recompute",
    "self-preempt": "If\n   the victim is the very request that asked, it waits for the next step",
    "fcfs-victim": "under\n   `fcfs` the most recently admitted running request",
    "no-admit-after-preempt": "Admit nobody in a step that preempted",
    "head-of-line": "nobody jumps the queue",
    "priority": "under `priority` the lowest\n   priority",
    "headroom": "`keep_free = self.admission_headroom * len(running)`",
    "continuous": "refilled at the next step, not when the whole batch is done",
    "exact-outputs": "gives\n  exactly the answers it gave before",
    "invariants": "a waiting request holds no\nblock, no block leaks, and in the end every request finishes",
}


def student_part() -> str:
    lab = spec.get("2")
    return (REPO / "docs/labs" / lab.handout).read_text().split("## For teachers")[0]


def test_every_check_of_lab2_has_its_rule_in_the_handout():
    lab = spec.get("2")
    assert {c.id for c in lab.checks} == set(RULES), "a check without its rule here: add the words that state it"
    text = student_part()
    missing = [check for check, words in RULES.items() if " ".join(words.split()) not in " ".join(text.split())]
    assert not missing, f"the handout's student part never states the rule of {missing}"
