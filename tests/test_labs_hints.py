"""A failed check points at its cause: the hints of the checks a planted bug fails name the bug's cause,
and a hypothesis failure is reported with its values, without instructions aimed at the test's author.

What it is (marker `labs`, no engine, no subprocess: the labs' definitions and one captured message):
  - for every lab, every planted bug, every check the bug fails (its `caught_by`, which
    tests/test_labs.py holds to exactly the checks that fail): each of the bug's `cause_words`
    is in that check's full hint (`--hints full`), so a student who made that mistake is
    told where to look; the cause itself is a phrase, and the short hint (the rule) stays
    an invariant, no code (tests/test_labs.py::test_every_check_has_a_rule_that_is_not_its_full_hint);
  - `labs.runner.failure_message` on a failure hypothesis reported: the falsifying example on
    one line with its values (an empty `seed=,` filled from the test's arguments in pytest's
    traceback), and no `@reproduce_failure` line for a test the student does not own.

What it is not: the run of each planted bug (tests/test_labs.py plants them).
"""

from __future__ import annotations

import pytest

from labs.runner import failure_message, frame_arguments
from labs.spec import all_labs

pytestmark = pytest.mark.labs

LABS = all_labs()
FAILS = [(lab, bug, check) for lab in LABS for bug in lab.bugs for check in bug.caught_by]


@pytest.mark.parametrize("lab", LABS, ids=lambda lab: lab.id)
def test_every_planted_bug_names_its_cause(lab):
    checks = {c.id for c in lab.checks}
    for bug in lab.bugs:
        assert bug.cause.strip() and 1 <= len(bug.cause_words) <= 3, f"lab {lab.id}, {bug.name}: cause, cause_words"
        assert all(w.strip() for w in bug.cause_words), f"lab {lab.id}, {bug.name}: an empty cause word"
        assert bug.caught_by and set(bug.caught_by) <= checks, f"lab {lab.id}, {bug.name}: {bug.caught_by}"


@pytest.mark.parametrize("lab,bug,check", FAILS, ids=[f"{lab.id}-{bug.name}-{c}" for lab, bug, c in FAILS])
def test_the_hint_of_a_check_a_bug_fails_names_the_cause(lab, bug, check):
    hint = " ".join(lab.check(check).hint.split()).lower()
    missing = [w for w in bug.cause_words if w.lower() not in hint]
    assert not missing, (
        f"lab {lab.id}: planted bug {bug.name} ({bug.cause}) fails {check}, whose full hint does not say "
        f"{missing}: {lab.check(check).hint.strip()}"
    )


# A failure as the runner records it (pytest's crash message, hypothesis 6.155): the explain phase left the
# values empty, which pytest's traceback shows as the test function's arguments.
HYPOTHESIS_FAILURE = """\
AssertionError: request 1 emitted [5, 2], the loop [5, 7]
assert [5, 2] == [5, 7]
Falsifying example: test_vectorised_sampler_equals_the_loop(
    # The test always failed when commented parts were varied together.
    seed=,  # or any other generated value
    K=,
    B=,
    V=,  # or any other generated value
)

You can reproduce this example by temporarily adding @reproduce_failure('6.155.2', b'AEEAQQJBA0EC') as a \
decorator on your test case"""
FRAMES = [{}, {"seed": "3", "K": "2", "B": "1", "V": "7"}, {"p": "tensor(...)", "K": "2"}]


def test_a_hypothesis_failure_shows_its_values_and_no_reproduce_decorator():
    msg = failure_message(HYPOTHESIS_FAILURE, FRAMES)
    assert msg.splitlines() == [
        "AssertionError: request 1 emitted [5, 2], the loop [5, 7]",
        "Falsifying example: test_vectorised_sampler_equals_the_loop(seed=3, K=2, B=1, V=7)",
        "assert [5, 2] == [5, 7]",
    ]
    # What a check prints of it (labs/cli.py: the first 160 characters of a detail) holds the values.
    assert "(seed=3, K=2, B=1, V=7)" in " ".join(msg.split())[:160]


def test_a_falsifying_example_with_its_values_is_kept_on_one_line():
    text = "ValueError: double free\nFalsifying example: test_free(\n    ids=[1,\n     1],\n    n=2,\n)\n"
    assert failure_message(text) == "ValueError: double free\nFalsifying example: test_free(ids=[1, 1], n=2)"
    no_frames = failure_message(HYPOTHESIS_FAILURE)  # a value nobody printed is a question mark, not a blank
    assert "(seed=?, K=?, B=?, V=?)" in no_frames and "reproduce" not in no_frames


def test_a_stateful_failure_keeps_its_steps_and_other_messages_are_unchanged():
    steps = "AssertionError: seq 2 reads [1, 9]\nFalsifying example:\nstate = Memory()\nstate.fork(parent=0)"
    seed = "You can add @seed(123) to this test or run pytest with --hypothesis-seed=123 to reproduce this failure."
    assert failure_message(f"{steps}\n\n{seed}") == steps
    plain = "NotImplementedError: lab 2: write Scheduler.schedule"
    assert failure_message(plain) == plain and len(failure_message("x" * 2000)) == 600


def test_the_arguments_come_from_the_failing_frames():
    """What the runner hands `failure_message`: every frame's arguments, a long repr cut short."""

    def test_x(seed, K, V):
        helper(K)

    def helper(k):
        raise AssertionError(k)

    try:
        test_x(3, 2, list(range(100)))
    except AssertionError as e:
        frames = frame_arguments(e.__traceback__, width=40)
    assert frames[1:] == [{"seed": "3", "K": "2", "V": "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11..."}, {"k": "2"}]
    example = failure_message(HYPOTHESIS_FAILURE.replace("    B=,\n", ""), frames).splitlines()[1]
    assert example.endswith("_loop(seed=3, K=2, V=[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11...)"), example
