"""Lab 6b: the live dashboard's picture of the block pool, and a stream that never falls behind.

What it is: the lab's definition (see `labs/spec.py`): in `level6_serving/dashboard.py`,
`block_states` (each block free, cached, used or shared, and the request it is drawn in) and
`DashboardHub._put` (a new frame for every open page, where a slow page skips to the newest
instead of queueing); the checks (`tests/test_dashboard.py`: the grid's reading of a small
pool, every frame against the engine's own state under random workloads at levels 3 and 4,
a shared prefix drawn shared and then cached, a slow reader); three planted bugs; the
experiment (`python -m benchmarks.watch`: level 3 serving the shared-prefix workload, with
the student's file drawing the page).

What it is not: the page itself (`static/dashboard.js`, read, not written) or the handout
(docs/labs/lab6b_dashboard.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

D = "tests/test_dashboard.py::"

PARTS = (
    Part(
        "block_states",
        """\
Two lists of snap.num_blocks entries. state: SHARED where snap.ref_counts says more than one request holds
the block, USED where exactly one does, CACHED where none does but the block is in snap.cached_free (a freed
block that still names a prefix), FREE otherwise. owner: the index in snap.requests of the FIRST request
whose block_ids contain the block (the colour the page draws it in), -1 for a block nobody holds.""",
    ),
    Part(
        "DashboardHub._put",
        """\
Runs on the event loop for every frame the feed makes. Remember it as self.latest (a page that connects
later starts from it), then offer it to every open stream: self._clients holds one asyncio.Queue(maxsize=1)
per page. A page that has not read its last frame must get this newer one instead (drop what is waiting,
then put), never wait, and never see an older frame after a newer one.""",
    ),
)

CHECKS = (
    Check("states", "a small pool read block by block: shared, used, cached, free, and who owns each",
          (D + "test_block_states_reads_shared_used_cached_and_free",),
          "state from ref_counts first (>1 shared, 1 used); a block with no holder is cached only if it is in "
          "snap.cached_free. owner: walk snap.requests in order and keep the first index seen for a block.",
          rule="A block's picture says how many hold it and whether a later request could still reuse it; its "
               "colour is its first holder's."),
    Check("frames", "every frame equals the engine's own state, under random workloads at levels 3 and 4",
          (D + "test_every_frame_equals_the_engine_state_and_the_steps_add_up",
           D + "test_the_prefix_is_drawn_shared_then_cached"),
          "If the states check passes, look at owner for shared blocks (the first holder, not the last) and at "
          "cached blocks (snap.cached_free lists them in eviction order; a set of it is enough here).",
          rule="What the page draws is the engine's state at that moment: blocks per request, reference counts, "
               "the evictable prefix blocks."),
    Check("slow-reader", "a page that reads slowly gets the newest frame, never a queue of old ones",
          (D + "test_a_slow_reader_skips_to_the_newest_frame", D + "test_the_server_streams_the_feeds_frames_while_it_serves"),
          "_put: for each queue, if q.full(): q.get_nowait() (drop the unread frame), then q.put_nowait(frame); "
          "and set self.latest first.",
          rule="Each open page costs one frame of memory however slowly it reads, and always sees the newest state."),
)  # fmt: skip

BUGS = (
    Bug("last-holder", "level6_serving.dashboard",
        "            if owner[b] < 0:\n                owner[b] = i\n", "            owner[b] = i\n", ("states", "frames")),
    Bug("cached-forgotten", "level6_serving.dashboard",
        "    cached = set(snap.cached_free)\n", "    cached = set()\n", ("states", "frames")),
    Bug("stale-frame", "level6_serving.dashboard",
        "            if q.full():\n                q.get_nowait()  # a slow reader skips to the newest frame\n",
        "            if q.full():\n                continue  # the reader has one already\n", ("slow-reader",)),
)  # fmt: skip

LAB = Lab(
    id="6b",
    topic="the live dashboard: the block pool as a picture, and a stream that never falls behind",
    handout="lab6b_dashboard.md",
    modules=(Module("level6_serving.dashboard", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("benchmarks.watch", ("--level", "3", "--workload", "shared-prefix", "--requests", "48"),
                          ("--port", "0", "--wait", "0", "--no-hold", "--pace", "0", "--requests", "4")),  # fmt: skip
    minutes=45,
)
