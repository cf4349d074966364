"""Lab 5: tensor parallelism: column- and row-parallel linears, and where the all-reduces go.

What it is: the lab's definition (see `labs/spec.py`): in `level5_multigpu/layers.py`, the
forwards of the column- and row-parallel linears, the vocabulary-parallel embedding and
LM head, which KV heads a rank holds, and how the fused QKV and gate/up weights are cut
into shards; the checks (level 5's own tests, one of them over two real processes on
gloo, and `labs/lab5_checks.py`, which runs 2 and 4 "ranks" as threads of one process
whose collectives meet at a barrier); the planted bugs (the bias added on every rank, an
embedding that forgets its all-reduce); and the experiment: TP=2 on gloo, communication
bytes per token against the model's count (`labs/lab5_experiment.py`).

What it is not: pipeline parallelism (the executor's) or the handout
(docs/labs/lab5_tensor_parallel.md).
"""

from __future__ import annotations

from .spec import Bug, Check, Experiment, Lab, Module, Part

L5 = "tests/test_level5.py::"
OWN = "labs/lab5_checks.py::"

PARTS = (
    Part(
        "ColumnParallelLinear.forward",
        """\
y_r = x W_r^T (+ b_r): this rank holds rows (outputs) of W and of the bias, so its output is a slice of
the full output, and nothing is communicated. [T, in] -> [T, out / tp].""",
    ),
    Part(
        "RowParallelLinear.forward",
        """\
This rank holds columns (inputs) of W, so x W_r^T is a *partial sum* of the full output: all-reduce it
(self.comm.all_reduce, a sum over the ranks of the stage). The bias is whole on every rank: add it once,
after the sum (added before, it would be counted tp times). [T, in / tp] -> [T, out].""",
    ),
    Part(
        "kv_heads_of_rank",
        """\
[first, last) of the KV heads this rank holds. Enough heads (num_kv_heads >= tp): an even split
(_split). Fewer heads than ranks: each head is replicated on tp // num_kv_heads consecutive ranks, and
rank r holds the one head r // (tp // num_kv_heads) (a ValueError if tp is not a multiple of
num_kv_heads): the KV head its query heads read.""",
    ),
    Part(
        "QKVParallelLinear.load",
        """\
This rank's q, k and v rows, in one weight [q rows; k rows; v rows] (and the same for the biases, if the
checkpoint has q_proj.bias):
  q: the rows of its query heads, _split(cfg.num_heads, tp, rank), head_dim rows per head;
  k, v: the rows of its KV heads, kv_heads_of_rank(cfg.num_kv_heads, tp, rank).
Read them with reader.read(f"{prefix}.q_proj.weight", rows=(first_row, last_row)) and so on (only the
slice is read from disk). Build the layer with cls(weight, bias) and set layer.sizes to the three
row counts, which split() uses to cut the output back into q, k and v.""",
    ),
    Part(
        "MergedColumnParallelLinear.load",
        """\
gate and up in one matmul, sharded per segment: this rank's weight is [its gate rows; its up rows], the
same rows r = _split(size, tp, rank) of both, so silu(gate) * up pairs the same features on every rank
(the biases likewise, if the checkpoint has gate_proj.bias).""",
    ),
    Part(
        "VocabParallelEmbedding.forward",
        """\
This rank holds the embedding rows of ids in [self.lo, self.hi). Look up every id clamped into this
range (ids - self.lo, clamped to 0 .. hi - lo - 1), zero the rows of ids that are not this rank's,
then all-reduce: the sum over ranks is the full embedding. [T] -> [T, hidden].""",
    ),
    Part(
        "ParallelLMHead.forward",
        """\
This rank computes the logits of its vocabulary range (hidden @ weight^T: [N, Vp / tp]); the shards are
gathered on TP rank 0 (self.comm.gather_to_first, which returns None on the others), and the padding
columns beyond self.vocab are dropped there. Return [N, vocab] or None.""",
    ),
)

CHECKS = (
    Check("column", "a column-parallel linear gives its slice of the outputs, no communication",
          (OWN + "test_column_parallel_is_a_slice",),
          "Rank r's ColumnParallelLinear holds rows of W and b: return linear(x, weight, bias). Its outputs are "
          "columns r*out/tp .. (r+1)*out/tp of the full y, and it sends nothing.",
          rule="A column-parallel layer computes its own slice of the outputs from the full input, and communicates "
               "nothing."),
    Check("row-bias", "a row-parallel linear all-reduces once and adds its bias once",
          (OWN + "test_row_parallel_sums_and_adds_the_bias_once",),
          "RowParallelLinear: all_reduce(linear(x, weight)) and then + bias. Adding the bias inside the linear "
          "puts it on every rank, and the all-reduce sums it tp times. Checkpoints without o/down biases never "
          "show this: the check uses one with them.",
          rule="A row-parallel layer's partial sums are combined once across the ranks, and its bias counts once in "
               "the total, not once per rank."),
    Check("vocab", "the vocabulary-parallel embedding and LM head (97 tokens padded to 98)",
          (OWN + "test_vocab_parallel_embedding_and_lm_head",),
          "Embedding: zero the rows of ids outside [lo, hi) before the all-reduce (a clamped lookup returns a "
          "real row for them). LM head: gather_to_first the local logits, drop the padding columns on TP rank 0, "
          "return None elsewhere.",
          rule="Each rank contributes only the vocabulary rows it owns (nothing for tokens outside its range), and "
               "the logits come back whole and without padding, on one rank only."),
    Check("shards", "every rank's shards put together give back the checkpoint (QKV by heads, gate/up per segment)",
          (L5 + "test_gathering_the_shards_gives_back_the_checkpoint[llama-2]",
           L5 + "test_gathering_the_shards_gives_back_the_checkpoint[llama3-2]",
           L5 + "test_gathering_the_shards_gives_back_the_checkpoint[qwen2-2]",
           L5 + "test_gathering_the_shards_gives_back_the_checkpoint[llama-4]", OWN + "test_kv_heads_of_each_rank"),
          "QKV: rank r reads the q rows of its query heads and the k, v rows of kv_heads_of_rank(...), "
          "head_dim rows per head, in one weight [q; k; v] with layer.sizes set. Gate/up: the same rows of "
          "both. With fewer KV heads than ranks, a head is replicated: rank r holds head r // (tp // Hkv).",
          rule="The ranks' shards together are exactly the checkpoint: a rank holds whole attention heads, the "
               "key/value heads its query heads read, and matching slices of fused weights."),
    Check("model", "the whole model on 2 and 4 simulated ranks equals the model on one",
          (OWN + "test_whole_model_on_simulated_ranks",),
          "The sharded model's logits differ from level 0's (biases on o/down and gate/up included). If a "
          "rank waits forever, the ranks did not call the same collectives in the same order.",
          rule="The sharded model computes the unsharded model's logits, and every rank calls the same collectives "
               "in the same order."),
    Check("gloo", "TP=2 over gloo: two all-reduces per layer plus one, with the bytes the shapes say",
          (L5 + "test_message_accounting_matches_the_model",),
          "Count the all-reduces: one in each row-parallel linear (o_proj, down_proj) and one in the "
          "embedding, of [T, hidden] each; the LM head gathers. Any other collective, or one missing, "
          "changes the count (and a missing one, the answer).",
          rule="The layout dictates the communication: exactly the collectives it needs, no more and no fewer, with "
               "the message sizes the shapes imply."),
)  # fmt: skip

BUGS = (
    Bug("bias-on-every-rank", "level5_multigpu.layers",
        "        y = self.comm.all_reduce(self.ops.linear(x, self.weight))  # [T, out], summed over ranks\n"
        "        return y if self.bias is None else y + self.bias\n",
        "        return self.comm.all_reduce(self.ops.linear(x, self.weight, self.bias))\n",
        ("row-bias", "model")),
    Bug("embedding-without-all-reduce", "level5_multigpu.layers",
        "        return self.comm.all_reduce(x * mine[:, None].to(x.dtype))\n",
        "        return x * mine[:, None].to(x.dtype)\n", ("vocab", "gloo")),
)  # fmt: skip

LAB = Lab(
    id="5",
    topic="tensor parallelism: column- and row-parallel layers, and where the all-reduces go",
    handout="lab5_tensor_parallel.md",
    modules=(Module("level5_multigpu.layers", PARTS),),
    checks=CHECKS,
    bugs=BUGS,
    experiment=Experiment("labs.lab5_experiment", (), ("--max-tokens", "3", "--requests", "1", "--no-calibrate")),
    minutes=120,
)
