"""Lab 3b: the fork, copy-on-write (level 3's `copy_on_write.py`).

What it is: the lab's definition (see `labs/spec.py`): in `level3_prefix/copy_on_write.py`,
`CopyOnWrite.fork` (a child holds its parent's blocks by reference count),
`CopyOnWrite.blocks_to_copy` (which blocks a step writes into that someone else holds) and
`CopyOnWrite.copy_block` (swap such a block for a copy and record the copy for the worker); the checks
(`labs/lab3b_checks.py`, the fork state machine, beam search against Hugging Face, and the
`n` samples' fork against level 2); two planted bugs; the experiment (the beam demo: the
student's manager under beam search and parallel sampling, its block tables drawn).

What it is not: the beam selection (`beam_search.py`, read, not written) or the handout
(docs/labs/lab3b_fork.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

B = "tests/test_beam_search.py::"
OWN = "labs/lab3b_checks.py::"

PARTS = (
    Part(
        "CopyOnWrite.fork",
        """\
A child's blocks (docs/beam_search.md, "The fork and copy-on-write"): the parent's `blocks`, in a *new
list* of the child's own, each block's count + 1 (self.pool.touch). Copy nothing; return the new list
(the manager gives the child the parent's bookkeeping too).""",
    ),
    Part(
        "CopyOnWrite.blocks_to_copy",
        """\
Indices into `held` of the blocks that the positions [start, end) fall in (block index = position //
self.block_size; only blocks `held` has) and that someone else holds too: held[i].ref_cnt > 1, where a
block at index >= num_own (a hit or forked block the sequence is about to touch) counts one more.""",
    ),
    Part(
        "CopyOnWrite.copy_block",
        """\
blocks[i] is shared and about to be written: take one fresh block (self.pool.allocate(1)), set its fill
(self.pool.fill) to the tokens of this sequence it holds (num_filled - i * block_size, between 0 and
block_size), record (old id, new id) in self.block_copies for the step (and count self.num_copied += 1),
put the new block in blocks[i], and drop this sequence's reference to the old one (self.pool.free([old])).""",
    ),
)

CHECKS = (
    Check("fork", "a fork shares every block and copies nothing",
          (OWN + "test_fork_shares_every_block_and_copies_nothing",),
          "fork: the child's list is a copy of the parent's list (not the same list object), every block "
          "touched once.",
          rule="After a fork the child reads exactly the parent's blocks, each counted once more, and no block "
               "is taken from the pool."),
    Check("copy-on-write", "a write into a shared block copies it first, once",
          (OWN + "test_a_write_into_a_shared_block_copies_it_first",
           OWN + "test_full_blocks_stay_shared_and_own_blocks_are_not_copied"),
          "blocks_to_copy: only the blocks the positions fall in, and only those with another holder "
          "(ref_cnt > 1). copy_block: record (old, new) and free the old one's reference.",
          rule="A sequence never writes into a block another sequence holds, and a block only it holds is "
               "never copied."),
    Check("state-machine", "fork, append, admit-as-fork and free against a model of the memory",
          (B + "TestForkMachine::runTest",),
          "Read the failing example's steps: a sequence that no longer reads its own tokens lost a copy (or "
          "wrote into a shared block); a wrong count is a missing touch or free.",
          rule="Every sequence always reads back its own tokens, every block's count equals its holders, and "
               "nothing leaks."),
    Check("beams", "beam search equals Hugging Face's, token for token",
          (B + "test_beam_search_equals_hf_without_eos[llama]", B + "test_beam_search_equals_hf_with_eos"),
          "If the state machine passes, look at the fill of the copy.",
          rule="Sharing blocks must not change what any beam computes."),
    Check("samples", "n samples fork after the prompt and equal level 2's",
          (B + "test_samples_fork_after_the_prompt", B + "test_forked_samples_under_pressure"),
          "An admitted fork's last prompt block is shared and written at once: blocks_to_copy must count "
          "the forked blocks it is about to touch (index >= num_own) as held by one more.",
          rule="A sample forked from its parent's prompt samples exactly what it would have alone."),
)  # fmt: skip

BUGS = (
    Bug("copy-not-recorded", "level3_prefix.copy_on_write",
        "        self.block_copies.append((old.block_id, new.block_id))\n",
        "", ("copy-on-write", "state-machine", "beams")),
    Bug("fork-not-counted", "level3_prefix.copy_on_write",
        "        self.pool.touch(shared)\n        return shared\n",
        "        return shared\n", ("fork", "state-machine")),
)  # fmt: skip

LAB = Lab(
    id="3b",
    topic="the fork: beams and samples share blocks, copy-on-write",
    handout="lab3b_fork.md",
    modules=(Module("level3_prefix.copy_on_write", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("level3_prefix.beam_demo", (), ("--max-tokens", "6", "--beam-width", "2")),
    minutes=60,
)
