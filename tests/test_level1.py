"""Level 1: the block allocator and block tables as a state machine, and the paged engine."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_equivalence import kv_bytes

import level0_naive
import level1_paged
from level0_naive import SamplingParams
from level1_paged.block_allocator import BlockAllocator, OutOfBlocks
from level1_paged.block_table import BlockTables
from level1_paged.model_input import ModelInput

pytestmark = pytest.mark.level1

GREEDY = dict(temperature=0, ignore_eos=True)


class BlockTablesMachine(RuleBasedStateMachine):
    """Random grow/free traffic: no leak, no double ownership, all-or-nothing growth."""

    def __init__(self):
        super().__init__()
        self.bt = BlockTables(num_blocks=12, block_size=4)
        self.tokens: dict[int, int] = {}  # our model of each live sequence's length
        self.next_id = 0

    @rule(n=st.integers(1, 30))
    def add_sequence(self, n):
        sid, self.next_id = self.next_id, self.next_id + 1
        self._grow(sid, n)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(1, 9))
    def grow_sequence(self, data, extra):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self._grow(sid, self.tokens[sid] + extra)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free_sequence(self, data):
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bt.free(sid)
        del self.tokens[sid]
        assert sid not in self.bt.tables

    def _grow(self, sid, n):
        before = list(self.bt.tables.get(sid, []))
        need = -(-n // 4) - len(before)
        if need > self.bt.allocator.num_free:
            with pytest.raises(OutOfBlocks):
                self.bt.grow(sid, n)
            assert self.bt.tables.get(sid, []) == before  # nothing half-done
            return
        self.bt.grow(sid, n)
        assert self.bt.tables[sid][: len(before)] == before  # a table only ever grows at the end
        self.tokens[sid] = n

    @invariant()
    def blocks_are_conserved_and_never_shared(self):
        owned = [b for t in self.bt.tables.values() for b in t]
        assert len(owned) == len(set(owned)), "a block belongs to two sequences"
        assert len(owned) + self.bt.allocator.num_free == 12, "a block leaked"
        assert not set(owned) & set(self.bt.allocator._free)

    @invariant()
    def tables_are_exactly_big_enough(self):
        for sid, n in self.tokens.items():
            assert len(self.bt.tables[sid]) == -(-n // 4)
        assert set(self.bt.tables) == set(self.tokens)  # a refused new sequence leaves no empty table

    def teardown(self):
        for sid in list(self.tokens):
            self.bt.free(sid)
        assert self.bt.allocator.num_free == 12


TestBlockTables = BlockTablesMachine.TestCase


def test_allocator_is_loud_on_misuse():
    alloc = BlockAllocator(2)
    a, b = alloc.allocate(), alloc.allocate()
    with pytest.raises(OutOfBlocks):
        alloc.allocate()
    alloc.free(a)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(a)
    with pytest.raises(ValueError, match="not in this pool"):
        alloc.free(7)
    assert alloc.num_free == 1 and b != a


def test_slots_follow_the_block_table():
    bt = BlockTables(num_blocks=8, block_size=4)
    bt.grow(0, 3)
    bt.grow(1, 4)
    bt.grow(0, 6)  # sequence 0's second block comes after sequence 1's
    assert bt.tables == {0: [0, 2], 1: [1]}
    # positions 2..5 of sequence 0 and a decode at position 3 of sequence 1, in one batch
    mi = ModelInput.build([([7, 7, 7, 7], 2), ([9], 3)], [bt.tables[0], bt.tables[1]], 4, [1, 1])
    assert mi.slot_mapping.tolist() == [2, 3, 8, 9, 7]
    assert mi.positions.tolist() == [2, 3, 4, 5, 3] and mi.query_start_loc.tolist() == [0, 4, 5]
    assert mi.seq_lens.tolist() == [6, 4] and mi.block_tables.tolist() == [[0, 2], [1, 0]]
    assert mi.logits_indices.tolist() == [3, 4]


def run(llm, prompts, lengths):
    return [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY) for n in lengths], progress=False)
    ]


def test_running_out_of_blocks_mid_batch_evicts_and_recomputes(llama_dir):
    """Admitted on their prompt size, the batch outgrows the pool: the youngest is evicted,
    recomputed later, and every answer is still the naive engine's."""
    prompts, lengths = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]], [20, 25, 18, 30]
    naive = run(level0_naive.LLM(llama_dir, dtype="float64"), prompts, lengths)
    paged = level1_paged.LLM(llama_dir, dtype="float64", block_size=4, kv_cache_memory=kv_bytes(llama_dir, 4 * 12))
    assert run(paged, prompts, lengths) == naive
    assert paged.stats.preemptions > 0
    engine = paged.llm_engine
    assert engine.blocks.allocator.num_free == engine.num_blocks and not engine.blocks.tables


def test_a_request_larger_than_the_pool_is_refused_up_front(llama_dir):
    paged = level1_paged.LLM(llama_dir, dtype="float64", block_size=4, kv_cache_memory=kv_bytes(llama_dir, 4 * 3))
    with pytest.raises(ValueError, match="KV blocks"):
        paged.generate([[1, 2], [1] * 10], SamplingParams(max_tokens=5), progress=False)
    assert paged.stats.steps == 0
    assert run(paged, [[1, 2]], [5]) == run(level0_naive.LLM(llama_dir, dtype="float64"), [[1, 2]], [5])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_waste_is_at_most_the_last_blocks_tail(llama_dir, block_size):
    """Reserved minus used is below one block per running sequence, at every step."""
    paged = level1_paged.LLM(llama_dir, dtype="float64", block_size=block_size)
    run(paged, [[1] * 5, [2] * 17, [3] * 2], [9, 30, 14])
    s = paged.stats
    slack = (s.kv_reserved_sum - s.kv_used_sum) / paged.llm_engine.bytes_per_token
    assert 0 <= slack <= (block_size - 1) * s.running_sum
    if block_size == 1:
        assert s.kv_waste == 0.0
