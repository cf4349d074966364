"""Lab 2b: Orca's reservations against paged blocks, on a simulated GPU (`benchmarks/sim/orca.py`).

What it is: the lab's definition (see `labs/spec.py`): in `benchmarks/sim/orca.py`,
`next_power_of_two`, `ReservingKVCacheManager.first_fit` (where a contiguous region of a size
goes, or that none fits) and `SimulatedOrca.reserve` (how much a request reserves under Orca
Max, Pow2 and Oracle); the checks (`tests/test_simulator.py`: the reservation sizes and first
fit's fragmentation, the PagedAttention paper's order of the systems at one request rate, and
the command that draws its figure 12); two planted bugs; the experiment (`python -m
benchmarks.simulate`: the student's reservations against level 2's paged blocks on a simulated
A100 serving OPT-13B).

What it is not: the cost model or the scheduler (read, not written), or the handout
(docs/labs/lab2b_what_if.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

S = "tests/test_simulator.py::"

PARTS = (
    Part(
        "next_power_of_two",
        """\
The smallest power of two that is >= n, and 1 for n <= 1 (Orca Pow2 rounds a request's true length up
to it). int.bit_length() tells how many bits a number needs.""",
    ),
    Part(
        "ReservingKVCacheManager.first_fit",
        """\
Regions are (start, size) in one address space [0, self.num_blocks) (self.regions: seq_id -> region).
Return the lowest start of a hole at least `size` long, walking the regions in address order: the
hole before each region, then the one after the last. None if no hole is big enough, or if fewer than
`keep_free` tokens would be left free in all (self.num_blocks - self.num_reserved - size).""",
    ),
    Part(
        "SimulatedOrca.reserve",
        """\
The request's true length is its prompt plus its target output length (self.targets[req.request_id]).
Orca Max reserves what it may grow to, req.max_total_tokens; Oracle its true length; Pow2 the next
power of two of its true length, never more than req.max_total_tokens (self.reservation says which).""",
    ),
)

CHECKS = (
    Check("reservations", "the three sizes, and first fit's holes",
          (S + "test_orca_reserves_max_pow2_or_oracle_and_first_fit_fragments",),
          "next_power_of_two: 1 << (n - 1).bit_length() for n > 1. first_fit: track the end of the previous "
          "region (`at`); a region starting at least `size` after it leaves a hole that fits.",
          rule="A region goes in the lowest hole it fits, and a free total too fragmented to hold it is no "
               "room at all."),
    Check("papers-order", "vLLM, Orca Oracle, Pow2, Max, FasterTransformer: the paper's order at 1.5 req/s",
          (S + "test_the_papers_order_at_one_rate",),
          "If the reservations check passes, look at reserve: Max is what the request may grow to (prompt + "
          "max_tokens), not its true length.",
          rule="The more a system reserves beyond a request's tokens, the fewer requests it batches and the "
               "slower it serves."),
    Check("command", "python -m benchmarks.simulate writes its tables and figure",
          (S + "test_the_command_writes_its_table",),
          "Run `python -m labs experiment 2b <dir>` and read the error: every Orca system calls your three "
          "functions.",
          rule="Every system in the figure runs to the end with your reservations."),
)  # fmt: skip

BUGS = (
    Bug("bump-allocator", "benchmarks.sim.orca",
        "            if start - at >= size:\n                return at\n", "", ("reservations",)),
    Bug("pow2-too-big", "benchmarks.sim.orca",
        "    return 1 << max(0, n - 1).bit_length()\n", "    return 1 << n.bit_length()\n", ("reservations",)),
)  # fmt: skip

LAB = Lab(
    id="2b",
    topic="Orca's contiguous reservations against paged blocks, on a simulated GPU",
    handout="lab2b_what_if.md",
    modules=(Module("benchmarks.sim.orca", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("benchmarks.simulate", ("--requests", "300", "--points", "5", "--tp", "1"),
                          ("--requests", "30", "--points", "2", "--no-plot")),  # fmt: skip
    minutes=45,
)
