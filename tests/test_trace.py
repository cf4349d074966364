"""`python -m ladder trace`: each level's chapter shows the call paths the tool prints, and the paths are the layering.

What it is (marker `docs`): for levels 0-5 (level 4 with `--spec`, level 5 with `--tp 2`), the
tool's output on the built-in model equals the ```text block of the level's chapter that starts
with the same command (so a change that moves a stage to another level, or renames a frame,
fails here until the chapter says so); and, read from the output itself, what the renovation
promised: a level's step reaches its own part (level 3's KV manager, level 4's rejection
sampler, level 5's rank), and the attention call ends in a room's kernel (level 0: its slab).

What it is not: a test of speed, or of the paths on a machine without a C++ compiler (the CPU's
attention is then level 1's torch backend, and the chapters show the compiled one: skipped, with
the reason).
"""

from __future__ import annotations

import re

import pytest

from benchmarks.trace import trace
from features.cpu_kernels import attention as cpu_attention
from ladder.models import REPO

pytestmark = [
    pytest.mark.docs,
    pytest.mark.skipif(not cpu_attention.available(), reason=f"the compiled CPU kernel did not build here: "
                       f"{cpu_attention.build_error()}; the chapters show its path"),
]  # fmt: skip

CASES = {  # level -> (the tool's arguments, the chapter that shows them)
    0: (["--level", "0"], "docs/level0_naive.md"),
    1: (["--level", "1"], "docs/level1_paged.md"),
    2: (["--level", "2"], "docs/level2_continuous.md"),
    3: (["--level", "3"], "docs/level3_prefix.md"),
    4: (["--level", "4", "--spec"], "docs/level4_speculative.md"),
    5: (["--level", "5", "--tp", "2"], "docs/level5_multigpu.md"),
}


def chapter_block(doc: str, command: str) -> str:
    """The ```text block of `doc` whose first line is `command`."""
    blocks = re.findall(r"^```text\n(.*?)^```", (REPO / doc).read_text(), re.S | re.M)
    found = [b.rstrip("\n") for b in blocks if b.splitlines()[0] == command]
    assert len(found) == 1, f"{doc} has {len(found)} blocks starting with {command!r}"
    return found[0]


@pytest.fixture(scope="module")
def outputs() -> dict[int, str]:
    return {level: trace(argv) for level, (argv, _) in CASES.items()}


@pytest.mark.parametrize("level", sorted(CASES))
def test_the_chapter_shows_what_the_tool_prints(outputs, level):
    argv, doc = CASES[level]
    out = outputs[level]
    assert out == chapter_block(doc, out.splitlines()[0]), f"{doc}: rerun `python -m ladder {' '.join(['trace', *argv])}`"


def frames(out: str, title: str) -> list[tuple[str, str, str]]:
    """(owner, file, function) rows of one path of the output."""
    lines = out.split(title + "\n", 1)[1].split("\n\n", 1)[0].splitlines()
    return [tuple(re.split(r"\s{2,}", line.strip())) for line in lines]


def test_each_level_reaches_its_own_part(outputs):
    blocks = {lvl: frames(outputs[lvl], "to the KV manager's allocation") for lvl in (2, 3, 4, 5)}
    assert blocks[2][-1][1:] == ("level2_continuous/kv_cache_manager.py", "SimpleKVCacheManager.allocate_slots")
    assert all(b[-1] == ("level 3", "level3_prefix/kv_cache_manager.py", "PrefixCachingKVCacheManager.allocate_slots")
               for lvl, b in blocks.items() if lvl >= 3)  # fmt: skip
    assert frames(outputs[4], "to the tokens it chooses")[-1][1:] == ("level4_speculative/rejection_sampler.py", "verify")
    attention5 = frames(outputs[5], "to the attention call")
    assert ("level 5", "level5_multigpu/rank.py", "RankWorker.execute") in attention5
    assert frames(outputs[0], "to the attention call")[-1] == ("level 0", "level0_naive/kv_cache.py", "causal_attention")
    for lvl in range(1, 6):
        assert frames(outputs[lvl], "to the attention call")[-1][0] == "room cpu_kernels"  # the CPU's default kernel


def test_the_defining_class_is_found_without_co_qualname():
    """Python 3.10 has no `co_qualname`: the tool then finds each frame's defining class through self's MRO
    (`defining_name`). Here, where both exist, the two agree on every frame of a level-3 step."""
    import sys

    import level3_prefix
    from benchmarks.trace import defining_name
    from ladder.models import BUILTIN

    if not hasattr(sys._getframe().f_code, "co_qualname"):
        pytest.skip("Python 3.10: no co_qualname to compare with")
    pairs = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(str(REPO)) and "self" in frame.f_locals:
            pairs.append((frame.f_code.co_qualname, defining_name(frame)))

    engine = level3_prefix.LLMEngine(str(BUILTIN), dtype="float32", max_model_len=64)
    engine.add_request("r", "ROMEO:", level3_prefix.SamplingParams(max_tokens=2, temperature=0))
    sys.setprofile(profile)
    try:
        engine.step()
    finally:
        sys.setprofile(None)
    methods = [(q, d) for q, d in pairs if "<" not in q]  # (a lambda or a nested function has no class to find)
    assert len(methods) > 100 and all(q == d for q, d in methods), [(q, d) for q, d in methods if q != d][:5]
