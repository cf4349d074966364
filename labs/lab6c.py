"""Lab 6c: data parallelism's router: which replica gets a request.

What it is: the lab's definition (see `labs/spec.py`): in `level6_serving/router.py`,
`chunk_hashes` (a prompt's first characters named chunk by chunk, each name covering everything
before it) and `Router.choose` (round-robin, least-loaded, and prefix-aware routing with its
balance rule); the checks (`tests/test_level6_dp.py`: the policies on recorded workloads, the
chained hashes, two real replicas behind the router giving the offline engine's answers, a
replica killed mid-stream); three planted bugs; the experiment (`python -m benchmarks.serving
--data-parallel-size 2`: DP=1 against DP=2, and round-robin against prefix-aware on the chat
workload, with the student's router).

What it is not: the relay, the metrics or the replicas' start-up (read, not written), or the
handout (docs/labs/lab6c_router.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

D = "tests/test_level6_dp.py::"

PARTS = (
    Part(
        "chunk_hashes",
        """\
The names of text's whole CHUNK_CHARS-character chunks, in order (a last partial chunk has none). Chain them
as level 3 names its blocks: chunk i's name is hashlib.blake2b(previous name + the chunk's bytes,
digest_size=16).digest(), the previous name of chunk 0 being b"". Two prompts then share name i exactly when
they share chunks 0..i.""",
    ),
    Part(
        "Router.choose",
        """\
Only live replicas (self.live()); none: raise LookupError. round-robin: the live replicas in turn
(next(self._turn) counts the calls). least-loaded: the live replica with the fewest in_flight, ties broken by
fewer sent. prefix-aware: for each live replica, how many of the prompt's leading chunk hashes it holds
(stop at the first it does not: r.chunks); take the longest match (ties: fewer in flight). Use the least
loaded instead when nothing matches, or when the best has BALANCE_SLACK or more requests in flight beyond
the least loaded. Remember the prompt's hashes for the chosen replica (self.remember), then return it.""",
    ),
)

CHECKS = (
    Check("hashes", "prompts that share their first chunks share those chunks' names, and only those",
          (D + "test_chunk_hashes_chain",),
          "prev = b''; for each whole chunk: prev = blake2b(prev + chunk.encode(), digest_size=16).digest(); append.",
          rule="A chunk's name covers the whole prompt up to it, so a shared name means a shared prefix."),
    Check("policies", "round-robin, least-loaded and prefix-aware on recorded workloads",
          (D + "test_round_robin_takes_the_live_replicas_in_turn", D + "test_least_loaded_takes_the_fewest_in_flight",
           D + "test_prefix_aware_keeps_a_prefix_on_one_replica_and_balances_the_rest"),
          "round-robin: live[next(self._turn) % len(live)]. prefix-aware: count leading hashes in r.chunks per "
          "replica; fall back to the least loaded when the match is 0 or the holder is too busy; self.remember.",
          rule="A policy only ever picks a live replica; prefix-aware keeps a shared prefix on one replica unless "
               "that replica is much busier than another."),
    Check("served", "two replicas behind your router answer as the offline engine; a dead one leaves rotation",
          (D + "test_a_killed_replica_fails_its_stream_cleanly_and_leaves_rotation",
           D + "test_two_replicas_give_the_offline_engines_answers"),
          "If the policies check passes, look at dead replicas: choose must never return one (r.alive).",
          rule="Routing changes where a request runs, never what it answers; a dead replica gets no request."),
)  # fmt: skip

BUGS = (
    Bug("dead-in-rotation", "level6_serving.router",
        "            return live[next(self._turn) % len(live)]\n",
        "            return self.replicas[next(self._turn) % len(self.replicas)]\n", ("policies", "served")),
    Bug("never-balance", "level6_serving.router",
        "        if best_match == 0 or best.in_flight - least.in_flight >= BALANCE_SLACK:\n",
        "        if best_match == 0:\n", ("policies",)),
    Bug("unchained", "level6_serving.router",
        "        prev = hashlib.blake2b(prev + text[i : i + CHUNK_CHARS].encode(), digest_size=16).digest()\n",
        "        prev = hashlib.blake2b(text[i : i + CHUNK_CHARS].encode(), digest_size=16).digest()\n", ("hashes",)),
)  # fmt: skip

LAB = Lab(
    id="6c",
    topic="data parallelism's router: round-robin, least-loaded and prefix-aware routing",
    handout="lab6c_router.md",
    modules=(Module("level6_serving.router", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("benchmarks.serving", ("--data-parallel-size", "2", "--repeats", "1"),
                          ("--quick", "--num-prompts", "8")),  # fmt: skip
    minutes=45,
)
