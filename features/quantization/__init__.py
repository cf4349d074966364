"""Room: quantization. Weights in 8 and 4 bits, quantized on load, read by the model's linears through the ops seam.

What it is: what `LLM(..., quantization="int8" | "int4")` asks for (vLLM's keyword; the formats are
gpt-fast's weight-only ones), in small files:

    formats.py   the two formats: how a weight is stored, dequantized, and multiplied (a reference that
                 dequantizes, and PyTorch's packed kernels where this machine has them)
    ops.py       `QuantizedOps`: level 0's ops seam, whose `linear` reads a quantized weight
    install.py   `quantize(model, method)`: every projection's weight replaced by its quantized form
                 (the embeddings, the norms and the LM head stay in the model's dtype)
    kv.py        `kv_cache_dtype="fp8" | "int8"`: the paged cache in 8 bits (level 1's cache and
                 attention backend ask for the format)
    demo.py      `python -m features.quantization.demo`: one KV budget, three formats, the requests each runs

    load (float weights) -> quantize each projection -> the model's ops become QuantizedOps(ops)
    a linear:  y = ops.linear(x, weight)  ->  weight.matmul(x)   (int8: x q^T * s; int4: group by group)

The seam: level 0's engine asks ladder/rooms.py for the ops and, after loading, for the quantized
model; level 5's ranks quantize their shards the same way. A level never imports this room.

What it is not (yet; issue 55): a GPU kernel for the weights (on CUDA both weight formats run the
reference; the 8-bit KV cache is read in place by level 1's Triton kernel and the compiled CPU kernel),
a quantizing cache write in a kernel, AWQ or GPTQ checkpoints. The simulator's dtypes are
benchmarks/sim/quantization.py's; lab 1d has students write the int8 cache's write and read.

Reference: gpt-fast `quantize.py`; vLLM `model_executor/layers/quantization/` (a `LinearMethodBase` per
method: `create_weights`, `apply`).
"""

from .formats import FORMATS, GROUP, Int4Weight, Int8Weight
from .install import METHODS, quantize, quantized_bytes
from .kv import FORMATS as KV_FORMATS
from .kv import Fp8KV, Int8KV, KVFormat, kv_format
from .ops import QuantizedOps

__all__ = [
    "FORMATS",
    "GROUP",
    "Int4Weight",
    "Int8Weight",
    "METHODS",
    "quantize",
    "quantized_bytes",
    "QuantizedOps",
    "KV_FORMATS",
    "KVFormat",
    "Fp8KV",
    "Int8KV",
    "kv_format",
]
