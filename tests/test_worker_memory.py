"""A test worker gives back the engines its tests dropped (tests/conftest.py's teardown hook).

What it is: an engine dropped in one test, whose KV pool (1 GiB on a CPU) only the cycle collector frees,
is gone when the next test starts, so a worker's memory does not grow engine by engine through a file
(`-m docs` grew one worker to 7.9 GB before the hook); and an engine behind a dropped server app, which
FastAPI's own caches kept reachable, is gone too. Each pair runs in order in one process.

What it is not: a measurement of a worker's peak (the README's quick start and the issue give the command).
"""

from __future__ import annotations

import pytest
from conftest import collect_now, resident_bytes

pytestmark = pytest.mark.docs

POOL = 256 << 20  # each engine's KV pool here: big enough to see, small enough for a busy machine
dropped: dict = {}


def test_a_dropped_engine_still_holds_its_pool(checkpoint_factory):

    from level0_naive.sampling_params import SamplingParams
    from level3_prefix import LLM

    if not resident_bytes():
        pytest.skip("no /proc/self/statm here: resident memory cannot be read")
    model = checkpoint_factory("llama", tokenizer=True)
    before = collect_now()  # the teardown's growth counts from here, whatever the worker ran before
    for _ in range(3):  # three engines, each dropped: only the cycle collector frees them
        llm = LLM(str(model), kv_cache_memory=POOL, device="cpu")
        llm.generate(["ab"], SamplingParams(max_tokens=2), progress=False)
        del llm
    dropped["rss"], dropped["held"] = resident_bytes(), resident_bytes() - before
    assert dropped["held"] > POOL  # at least one pool outlived its engine


def test_the_next_test_starts_without_it():
    if "rss" not in dropped:
        pytest.skip("the test before did not run")
    freed = dropped["rss"] - resident_bytes()
    assert freed > dropped["held"] - POOL // 2, f"{freed >> 20} MB of the {dropped['held'] >> 20} MB held came back"


def test_a_dropped_server_app_still_holds_its_engine():
    """FastAPI's own caches keep every endpoint it inspected, and an endpoint closes over its engine."""
    import gc
    import weakref

    from level6_serving import AsyncLLMEngine
    from level6_serving.api_server import build_app

    pool = 3 * POOL  # more than the growth the hook waits for
    collect_now()  # counted from here, whatever the worker ran before
    engine = AsyncLLMEngine.from_engine_args("tiny-shakespeare", max_model_len=256, kv_cache_memory=pool)
    build_app(engine, ["tiny-shakespeare"])
    dropped["app"] = weakref.ref(engine)
    del engine
    gc.collect()
    if dropped["app"]() is None:
        pytest.skip("this FastAPI keeps no endpoint: nothing to give back")


def test_the_next_test_starts_without_that_engine():
    if "app" not in dropped:
        pytest.skip("the test before did not run")
    assert dropped["app"]() is None, "the dropped app's engine is still alive"
