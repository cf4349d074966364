"""`python -m benchmarks.dashboard_cost`: what an open dashboard costs the engine's steps.

What it is: the level-6 server (this process, the built-in tiny model, one torch thread)
running one batch of `--batch` requests (64 by default: every one in the same steps, decode
after a one-step prefill) to `--tokens` output tokens each, with the dashboard

    closed   the feed attached (as the server always has it) but nobody watching: no snapshot
    open     a page's event stream open, read by a separate process (so the reader costs
             this process nothing): a snapshot, a frame and its JSON five times a second

in alternating order, `--repeats` times each (a shared machine drifts; a ratio from one run
drifts less). The figure is the wall time per engine step over the whole batch (every
step's observer call and the event loop's encoding included, since both share the GIL with
the engine thread), and open / closed as a ratio; also the frames the reader got and their size.

    python -m benchmarks.dashboard_cost                  # batch 64, 128 tokens, 3 repeats
    python -m benchmarks.dashboard_cost --batch 128 --repeats 5

What it is not: a test (it reports; nothing fails on a number).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from ladder.cli import LadderParser, positive_int, prog, torch_threads

# The page's stand-in, in a process of its own (its reading costs the server's process nothing):
# one line per frame, its size in bytes.
READER = """
import sys, httpx
with httpx.stream("GET", sys.argv[1] + "/dashboard/events", timeout=None) as s:
    for line in s.iter_lines():
        if line.startswith("data: "):
            print(len(line), flush=True)
"""


def parser() -> argparse.ArgumentParser:
    p = LadderParser(prog=prog("benchmarks.dashboard_cost"), description=__doc__.split("\n\n")[1])
    p.add_argument("--batch", type=positive_int, default=64)
    p.add_argument("--tokens", type=positive_int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--prompt", type=positive_int, default=16, help="prompt tokens per request (default 16)")
    p.add_argument("--repeats", type=positive_int, default=3)
    return p


async def one_batch(engine, batch: int, prompt: int, tokens: int, tag: str) -> None:
    from level6_serving import SamplingParams

    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0)

    async def one(i: int) -> None:
        async for _ in engine.generate([(7 * i + j) % 60 + 3 for j in range(prompt)], params, f"{tag}-{i}"):
            pass

    await asyncio.gather(*(one(i) for i in range(batch)))


def wait_until(condition, reader, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or (reader is not None and reader.poll() is not None):
            raise RuntimeError("the reader process did not connect (or the server did not see it go) in time")
        time.sleep(0.01)


async def frame_cost(engine, feed, args, n: int = 50) -> float:
    """Seconds one frame costs (snapshot + frame + JSON), timed on the engine thread mid-batch."""

    def measure(core) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            json.dumps(feed.capture(core), separators=(",", ":"))
        return (time.perf_counter() - t0) / n

    batch = asyncio.ensure_future(one_batch(engine, args.batch, args.prompt, args.tokens, "frame-cost"))
    await asyncio.sleep(0.5)  # every request running (one step admits the whole batch), past its prefill
    seconds = await engine.call(measure)
    await batch
    return seconds


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    from ladder.models import default_model
    from level6_serving import AsyncLLMEngine
    from level6_serving.api_server import ServerThread, build_app
    from level6_serving.dashboard import HZ

    with torch_threads(1):
        engine = AsyncLLMEngine.from_engine_args(str(default_model()), max_model_len=args.prompt + args.tokens + 16,
                                                 max_num_seqs=args.batch, kv_cache_memory=256 << 20, seed=0)  # fmt: skip
        app = build_app(engine, ["tiny"])
        hub, core = app.state.dashboard, engine.engine
        results: dict[str, list[float]] = {"closed": [], "open": []}
        frames: list[tuple[int, int]] = []  # (frames, bytes) per open run
        made: list[int] = []  # frames the feed made per open run
        srv = ServerThread(app)
        with srv as url:
            run = lambda tag: asyncio.run_coroutine_threadsafe(  # noqa: E731
                one_batch(engine, args.batch, args.prompt, args.tokens, tag), srv.server.loop).result()
            run("warm-up")
            for r in range(args.repeats):
                for mode in ("closed", "open") if r % 2 == 0 else ("open", "closed"):
                    reader = None
                    if mode == "open":
                        reader = subprocess.Popen([sys.executable, "-c", READER, url], stdout=subprocess.PIPE, text=True)
                        wait_until(lambda: hub.watched, reader)
                    steps, t0, seq = len(core.step_log), time.perf_counter(), hub.feed.seq
                    run(f"{mode}{r}")
                    seconds = time.perf_counter() - t0
                    n = len(core.step_log) - steps if len(core.step_log) < core.step_log.maxlen else None
                    n = n or sum(1 for s in core.step_log if s.time >= t0)  # a full ring buffer: count by time
                    results[mode].append(seconds / n)
                    if reader is not None:
                        reader.terminate()
                        lines = reader.communicate()[0].split()
                        frames.append((len(lines), sum(map(int, lines))))
                        made.append(hub.feed.seq - seq)
                        wait_until(lambda: not hub.watched, None)  # the server has seen the reader go
            per_frame = asyncio.run_coroutine_threadsafe(frame_cost(engine, hub.feed, args), srv.server.loop).result()
    closed, opened = min(results["closed"]), min(results["open"])
    ratios = [o / c for o, c in zip(results["open"], results["closed"])]
    n_frames, n_bytes = sum(f for f, _ in frames), sum(b for _, b in frames)
    print(f"batch {args.batch}, {args.tokens} output tokens each, {args.repeats} repeats (ms per engine step)")
    print(f"  closed: {' '.join(f'{1e3 * s:.2f}' for s in results['closed'])}   best {1e3 * closed:.2f}")
    print(f"  open:   {' '.join(f'{1e3 * s:.2f}' for s in results['open'])}   best {1e3 * opened:.2f}")
    print(f"  open / closed: best {opened / closed:.4f}, median of pairs {statistics.median(ratios):.4f} "
          f"(cost {100 * (opened / closed - 1):+.2f} %)")  # fmt: skip
    print(f"  one frame, taken mid-batch on the engine thread: {1e3 * per_frame:.3f} ms (snapshot, frame, JSON): "
          f"at {HZ:g} a second, {100 * HZ * per_frame:.2f} % of the engine's time")  # fmt: skip
    print(f"  the feed made {sum(made)} frames while open, the reader got {n_frames}, "
          f"{n_bytes / max(n_frames, 1) / 1024:.1f} KiB each")  # fmt: skip
    return {"closed": results["closed"], "open": results["open"], "ratio_best": opened / closed,
            "ratio_median": statistics.median(ratios), "frames": n_frames, "bytes": n_bytes}  # fmt: skip


if __name__ == "__main__":
    main()
