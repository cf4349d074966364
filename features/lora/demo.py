"""`python -m features.lora.demo`: one prompt written four ways in one batch, the base model and three adapters.

    python -m features.lora.demo                        # the built-in model and its three adapters
    python -m features.lora.demo --prompt "ROMEO:" --max-tokens 120
    python -m features.lora.demo --quick                # fewer tokens (seconds)
    python -m features.lora.demo --tp 2                 # and the same batch over 2 tensor-parallel ranks (level 5)

What it is: the built-in tiny Shakespeare model served with `enable_lora=True` and the three
adapters models/train_lora.py made from parts of the corpus (models/tiny-shakespeare-loras/:
the speeches of Romeo and Juliet, of Richard III's court, the plays in capitals). The same prompt goes in four times, once on
the base model and once on each adapter, as one `generate` call: every step runs the four rows in one
batch, each projection adding its row's own adapter (docs/lora.md). Printed: the four greedy
continuations, the slots the adapters sat in and the last step's mapping (each row's slot, -1 for
the base model), then the same four one at a time, to show that batching changed no token, and the
batch on each path (cpu_ops.py's compiled loop, punica.py's stacked, segmented, gathered and loop; the
Triton kernels too on a GPU), timed
(in float64, where a near-tie that a batch's other rounding could flip is vanishingly rare). With
`--tp N`, the batch once more over N ranks, each holding its shard of every adapter (sharded.py).

What it is not: a benchmark (`python -m benchmarks.lora` measures mixed against one adapter at a
time), or the adapters' training (models/train_lora.py).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ladder.models import default_model
from level0_naive import SamplingParams
from level3_prefix import LLM, LoRARequest

from .slots import DELTAS

ADAPTERS = Path(__file__).resolve().parents[2] / "models" / "tiny-shakespeare-loras"
NAMES = ("verona", "richard", "capitals")


def runnable() -> list[str]:
    """The delta paths this machine runs in seconds: the compiled loop where it builds, the Triton kernels on a GPU
    (on a CPU only Triton's interpreter runs them: minutes)."""
    from . import cpu_ops

    return [d for d in DELTAS if (d != "triton" or torch.cuda.is_available()) and (d != "cpu" or cpu_ops.available())]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m features.lora.demo", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny Shakespeare model)")
    p.add_argument("--adapters", type=Path, default=ADAPTERS, help="a folder of PEFT adapters, one per sub-folder")
    p.add_argument("--prompt", default="I pray you, sir, what news?\n\n",
                   help="the same for all four (default: a line and a blank one, so the next speaker is the model's)")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--path", default="auto", choices=["auto", *runnable()],
                   help="the delta's way (punica.py, cpu_ops.py; default auto: the compiled loop on a CPU where it "
                        "builds, else stacked; triton on a GPU)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="24 tokens")
    p.add_argument("--tp", type=int, default=1, help="also run the batch over this many tensor-parallel ranks")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    names = [n for n in NAMES if (args.adapters / n).is_dir()] or sorted(d.name for d in args.adapters.iterdir())
    loras = [None] + [LoRARequest(n, i + 1, str(args.adapters / n)) for i, n in enumerate(names)]
    llm = LLM(args.model or str(default_model()), dtype="float64", enable_lora=True, max_loras=len(names),
              max_lora_rank=8, seed=0)  # fmt: skip
    llm.llm_engine.lora.path = args.path
    params = SamplingParams(max_tokens=24 if args.quick else args.max_tokens, temperature=0)
    t0 = time.perf_counter()
    batched = llm.generate([args.prompt] * len(loras), params, lora_request=loras, progress=False)
    seconds = time.perf_counter() - t0
    manager = llm.llm_engine.lora
    mapping, slots = manager.slots.mapping.tolist(), {slot: i for i, slot in manager.slot_of.items()}
    print(f"prompt: {args.prompt!r}   (the {manager.path} path: {seconds:.2f} s for the batch)\n")
    texts = {}
    for lora, out in zip(loras, batched):
        name = "base model" if lora is None else f"adapter {lora.lora_name}"
        texts[name] = out.outputs[0].text
        print(f"--- {name} ---\n{texts[name].rstrip()}\n")
    print("slots: " + "   ".join(f"{s}: {names[slots[s] - 1]}" for s in sorted(slots)))
    print(f"the last step's rows, each one's slot (-1: the base model): {mapping}")
    alone = [llm.generate([args.prompt], params, lora_request=lora, progress=False)[0].outputs[0].text
             for lora in loras]  # fmt: skip
    same = alone == list(texts.values())
    print(f"one at a time, the same text as in one batch: {same}")
    times = {}
    for path in runnable():  # the same batch on each path (its adapters already in their slots)
        llm.llm_engine.lora.path = path
        t0 = time.perf_counter()
        again = llm.generate([args.prompt] * len(loras), params, lora_request=loras, progress=False)
        times[path] = time.perf_counter() - t0
        same = same and [o.outputs[0].text for o in again] == list(texts.values())
    print("the batch again on each path: " + ", ".join(f"{p} {t:.2f} s" for p, t in times.items())
          + f"; the same text every way: {same}")  # fmt: skip
    if args.tp > 1:  # level 5: each rank holds its shard of every slot, the delta joins each row-parallel sum
        from level5_multigpu import LLM as ParallelLLM

        with ParallelLLM(args.model or str(default_model()), dtype="float64", enable_lora=True, max_loras=len(names),
                         max_lora_rank=8, seed=0, tensor_parallel_size=args.tp) as sharded:  # fmt: skip
            over = sharded.generate([args.prompt] * len(loras), params, lora_request=loras, progress=False)
        same = same and [o.outputs[0].text for o in over] == list(texts.values())
        print(f"over {args.tp} tensor-parallel ranks (level 5): the same text: {same}")
    return {"texts": texts, "mapping": mapping, "same": same, "seconds": times}


if __name__ == "__main__":
    main()
