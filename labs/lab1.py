"""Lab 1: the block allocator, block tables and the slot mapping (PagedAttention's memory side).

What it is: the lab's definition (see `labs/spec.py`): three files of level 1, each with
the functions that are the idea emptied (`BlockAllocator.allocate`/`free` in block_allocator.py;
`blocks_for` and `BlockTables.missing_blocks`/`grow`/`free` in block_table.py; `slot_mapping`
in slot_mapping.py, where a position becomes a cache slot), the checks (level 1's own tests and `labs/lab1_checks.py`), the
planted bugs (a slot off by one, a freed block that never comes back), and the
experiment: KV waste and concurrency against level 0 at the same budget
(`python -m level1_paged.demo` with the student's files).

What it is not: the kernel (lab 1b) or the handout (docs/labs/lab1_paged.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

L1 = "tests/test_level1.py::"
OWN = "labs/lab1_checks.py::"

ALLOCATOR = (
    Part(
        "BlockAllocator.allocate",
        """\
Hand out one free block id in O(1), or raise OutOfBlocks (with a message) when none is left.
self._free is a stack (pop from the end: blocks come out 0, 1, 2, ...); keep self._is_free in step.""",
    ),
    Part(
        "BlockAllocator.free",
        """\
Give a block back in O(1). Be loud on misuse, the allocator's whole point:
  an id outside 0 .. num_blocks-1 -> ValueError saying it is "not in this pool";
  a block that is already free -> ValueError saying "double free".
Then mark it free and push it on self._free.""",
    ),
)
TABLES = (
    Part("blocks_for", "How many blocks of block_size tokens hold num_tokens tokens: a ceiling division."),
    Part(
        "BlockTables.missing_blocks",
        """\
How many blocks seq_id still lacks to hold num_tokens tokens (never negative; a sequence with no
table yet has none).""",
    ),
    Part(
        "BlockTables.grow",
        """\
Make seq_id's table cover num_tokens tokens, all or nothing: if the allocator has fewer free blocks
than are missing, raise OutOfBlocks and change nothing (not even an empty table for a new sequence).
Otherwise append the new blocks at the end of its table: a table only ever grows at the end.""",
    ),
    Part(
        "BlockTables.free",
        """\
Give every block of seq_id back to the allocator and forget its table (an unknown seq_id: nothing).""",
    ),
)
SLOTS = (
    Part(
        "slot_mapping",
        """\
One slot per new token, in batch order (read the picture in this file's docstring): for sequence i, its
chunk's tokens sit at positions start .. start + len(toks) - 1 of the whole sequence, and the token at
position p goes to slot  table[p // block_size] * block_size + p % block_size  of its table tables[i].
A position is the token's place in the sequence, never in the chunk.""",
    ),
)

CHECKS = (
    Check("allocator", "the allocator hands out and takes back blocks, loud on misuse",
          (L1 + "test_allocator_is_loud_on_misuse", OWN + "test_allocator_order_and_reuse"),
          "allocate() pops from self._free (OutOfBlocks when empty); free() raises ValueError for an id out of "
          "range ('not in this pool') and for a block already free ('double free'), and pushes it back.",
          rule="Every block is either free or handed out, never both: the pool runs out loudly, and freeing a block "
               "that is not out (or not in the pool) is an error, not a silent no-op."),
    Check("tables", "block tables grow all-or-nothing, at the end, and never leak or share a block",
          (L1 + "TestBlockTables",),
          "grow() must check that enough blocks are free before taking any (OutOfBlocks, table unchanged, and "
          "no empty table left behind for a new sequence); free() must return every block of the table; "
          "blocks_for is a ceiling division.",
          rule="Growing a table is all or nothing: when the pool cannot cover the new tokens, nothing changes. A "
               "sequence holds just enough blocks for its tokens, no block is in two tables, and a freed table gives "
               "every block back."),
    Check("slot-mapping", "slot = table[pos // block_size] * block_size + pos % block_size, for every new token",
          (L1 + "test_slots_follow_the_block_table", OWN + "test_model_input_on_random_batches"),
          "For a new token at position p (the chunk's start + its index), the slot is table[p // bs] * bs + "
          "p % bs, one per new token in batch order (ModelInput.build turns the list into the step's tensor).",
          rule="Each new token's key and value go to the slot its sequence's block table assigns to its position in "
               "the whole sequence (not in the chunk); the batch's metadata describes every sequence's full length."),
    Check("engine", "level 1 runs out of blocks mid-batch, evicts, recomputes, and answers exactly",
          (L1 + "test_running_out_of_blocks_mid_batch_evicts_and_recomputes",
           L1 + "test_a_request_larger_than_the_pool_is_refused_up_front"),
          "The engine's answers changed, or blocks were left behind: a K/V written to the wrong slot, a block "
          "not returned when a request finishes or is evicted, or a table that shrank.",
          rule="Running out of blocks mid-batch may cost recomputation, never an answer: outputs stay exact, and "
               "every block comes back when a request finishes or is evicted."),
)  # fmt: skip

BUGS = (
    Bug("slot-off-by-one", "level1_paged.slot_mapping", "return [t[p // bs] * bs + p % bs for",
        "return [t[p // bs] * bs + p % bs + 1 for", ("slot-mapping",)),
    Bug("free-forgets-the-block", "level1_paged.block_allocator", "        self._free.append(block)\n", "",
        ("allocator", "tables")),
)  # fmt: skip

LAB = Lab(
    id="1",
    topic="paged KV memory: the block allocator, block tables and the slot mapping",
    handout="lab1_paged.md",
    modules=(
        Module("level1_paged.block_allocator", ALLOCATOR),
        Module("level1_paged.block_table", TABLES),
        Module("level1_paged.slot_mapping", SLOTS),
    ),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment(
        "level1_paged.demo",
        (),
        ("--requests", "4", "--max-tokens", "12", "--budget-requests", "2", "--block-size", "4", "--no-progress"),
    ),  # fmt: skip
    minutes=90,
)
