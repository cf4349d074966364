"""Compile every Triton kernel ahead of time for GPUs this machine does not have.

What it is
    Compiles level 1's two kernels (``_paged_attention_kernel`` and ``_write_kv_kernel`` in
    ``level1_paged/triton_attention.py``; lab 1b's reference is that same module) for sm_80
    (A100), sm_86 (RTX 30xx, A10, laptops) and sm_90 (H100) at the shapes the engine launches,
    with the installed Triton and its bundled ptxas: no GPU, no CUDA driver. For each it
    reports the shared memory a program asks for, against the target's per-block limit, and
    the registers per thread and spilled bytes that ptxas reports. ``python -m
    benchmarks.kernel_compile`` prints the markdown table in docs/level1_kernel.md;
    tests/test_kernel_compile.py compiles the sm_80/sm_90 part of the grid, and the LoRA room's
    shrink and expand (``features/lora/triton_ops.py``: kernels "lora_shrink", "lora_expand").

How
    Each compile runs in a worker subprocess with ``TRITON_INTERPRET=0``: a process that
    imported triton under the interpreter (any CPU test run) cannot compile. The kernel's
    signature comes from Triton's own launch binder, fed stand-in CPU tensors of the
    launch's shapes, so the specialisation (16-byte aligned pointers, strides divisible
    by 16) is what ``kernel[grid](...)`` on a GPU would compile; the constexprs come from
    ``_kernel_constexprs``, the function ``_launch`` uses.

What it is not
    Not a run or a timing. Registers and spills come from ptxas's log, which only Triton
    >= 3.5 exposes (``knobs.nvidia.dump_ptxas_log``); older ones report shared memory only.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: workers run `-m` from it

# Max shared memory per block with the opt-in attribute (Triton asks for it), by compute
# capability: the CUDA C++ Programming Guide's table. A launch asking for more fails
# with triton.runtime.errors.OutOfResources.
SMEM_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 90: 227 * 1024}
GPU_NAMES = {80: "A100", 86: "RTX 30xx, A10", 90: "H100"}

# (name, query heads, KV heads, head dim): the built-in models (models/*/config.json), the
# 1B Llama the docs use, and head dims 80 and 128 at the GQA groups real models use.
SHAPES = [
    ("tiny-shakespeare", 4, 2, 64),
    ("tiny-shakespeare-draft", 2, 1, 64),
    ("tiny-shakespeare-moe", 4, 2, 48),
    ("Llama-3.2-1B", 32, 8, 64),
    ("Phi-2 (head dim 80)", 32, 32, 80),
    ("Llama-3.1-8B (head dim 128)", 32, 8, 128),
]
DTYPES = ["float16", "bfloat16", "float32", "float64"]


@dataclass(frozen=True)
class Config:
    kernel: str  # "attention" or "write_kv"
    arch: int  # compute capability, 80 for sm_80
    dtype: str  # a torch dtype's name
    shape: str
    hq: int
    hkv: int
    head_dim: int
    block_size: int = 16  # the attention kernel's only: write_kv copies a token's row whatever the block
    tile: int = 32
    rank: int = 16  # the LoRA kernels' only (lora_shrink, lora_expand): max_lora_rank
    kv: str = ""  # the attention kernel's cache: "" the model's dtype, "fp8" or "int8" (KV_QUANT)


@dataclass
class Result:
    config: Config
    shared: int | None = None  # bytes per program
    registers: int | None = None  # per thread
    spills: int | None = None  # bytes stored + loaded to local memory
    error: str | None = None

    @property
    def over_limit(self) -> bool:
        return self.shared is not None and self.shared > SMEM_LIMIT[self.config.arch]


def fp64_supported() -> bool:
    """Whether the installed Triton compiles tl.dot on fp64 (triton_attention.FP64_DOT_TRITON)."""
    from level1_paged.triton_attention import _check_fp64_supported

    try:
        _check_fp64_supported()
    except RuntimeError:
        return False
    return True


def grid(archs=(80, 86, 90)) -> list[Config]:
    """The engine's launches: every shape x block size 16/32 x dtype x target, both kernels
    (fp64 where the installed Triton compiles it), and the attention over an fp8 and an int8 cache
    (kv_cache_dtype) for bfloat16 models at block size 16."""
    dtypes = [d for d in DTYPES if d != "float64" or fp64_supported()]
    configs = []
    for arch in archs:
        for dtype in dtypes:
            for name, hq, hkv, d in SHAPES:
                configs.append(Config("write_kv", arch, dtype, name, hq, hkv, d))
                configs += [Config("attention", arch, dtype, name, hq, hkv, d, bs) for bs in (16, 32)]
        for name, hq, hkv, d in SHAPES:
            configs += [Config("attention", arch, "bfloat16", name, hq, hkv, d, kv=kv) for kv in ("fp8", "int8")]
    return configs


def compile_all(configs: list[Config], jobs: int | None = None) -> list[Result]:
    """Compile each config in `jobs` worker subprocesses; results in the configs' order."""
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(configs)))
    chunks = [configs[i::jobs] for i in range(jobs)]
    with tempfile.TemporaryDirectory() as cache:
        # A throwaway cache, and no cache hits: two configs may be the same kernel, and a hit has no ptxas log.
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": cache, "TRITON_ALWAYS_COMPILE": "1"}

        def run(chunk: list[Config]) -> list[dict]:
            done = subprocess.run(
                [sys.executable, "-m", "benchmarks.kernel_compile", "--worker"],
                input=json.dumps([asdict(c) for c in chunk]),
                capture_output=True,
                text=True,
                env=env,
                cwd=ROOT,
            )
            if done.returncode != 0:
                raise RuntimeError(f"kernel_compile worker failed:\n{done.stderr[-4000:]}")
            return json.loads(done.stdout)

        with ThreadPoolExecutor(jobs) as pool:
            outputs = list(pool.map(run, chunks))
    by_config = {c: Result(c, **r) for chunk, out in zip(chunks, outputs) for c, r in zip(chunk, out)}
    return [by_config[c] for c in configs]


def _compile_one(c: Config) -> Result:
    """In a worker: the compile a GPU launch of config `c` would do, for target c.arch."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from level1_paged import triton_attention as ta

    dtype = getattr(torch, c.dtype)
    if c.kernel == "attention":
        kernel = ta._paged_attention_kernel
        q = torch.empty(8, c.hq, c.head_dim, dtype=dtype)  # [T, Hq, D]
        # [N, bs, Hkv, D]; an 8-bit cache as paged_attention_triton_8bit views it (int8: D + 4 bytes a head)
        width, cache_dtype = {"": (c.head_dim, dtype), "fp8": (c.head_dim, torch.float8_e4m3fn),
                              "int8": (c.head_dim + 4, torch.int8)}[c.kv]  # fmt: skip
        cache = torch.empty(4, c.block_size, c.hkv, width, dtype=cache_dtype)
        tables = torch.zeros(3, 5, dtype=torch.int32)  # 3 sequences, 5 blocks each: typical strides
        lens = torch.zeros(3, dtype=torch.int32)
        scale = torch.zeros(1, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
        strides = (*q.stride()[:2], *q.stride()[:2], *cache.stride()[:3], *cache.stride()[:3], tables.stride(0))
        qsl = torch.zeros(4, dtype=torch.int32)
        args = (q, q, cache, cache, tables, lens, qsl, scale, scale, scale, 3, *strides)
        kv_quant = ta.KV_QUANT.get(c.kv, 0)
        constexprs = ta._kernel_constexprs(c.hq // c.hkv, c.block_size, c.head_dim, dtype, c.tile, kv_quant)
    elif c.kernel in ("lora_shrink", "lora_expand"):  # features/lora/triton_ops.py on q_proj: in = out = Hq x D
        from features.lora import triton_ops as lo

        acc = torch.float64 if dtype == torch.float64 else torch.float32
        x = torch.empty(8, c.hq * c.head_dim, dtype=dtype)  # [T, in]
        A, B = torch.empty(4, c.rank, x.shape[1], dtype=dtype), torch.empty(4, x.shape[1], c.rank, dtype=dtype)
        shrunk, scale, idx = torch.empty(8, c.rank, dtype=acc), torch.empty(4, dtype=dtype), torch.zeros(8).long()
        block_r = min(lo.BLOCK_R, triton.next_power_of_2(c.rank))  # as delta_triton chooses
        if c.kernel == "lora_shrink":
            kernel, constexprs = lo._shrink_kernel, dict(BLOCK_R=block_r, BLOCK_IN=lo.BLOCK_IN)
            args = (shrunk, x, A, scale, idx, c.rank, x.shape[1], *x.stride(), *A.stride())
        else:
            kernel, constexprs = lo._expand_kernel, dict(BLOCK_R=block_r, BLOCK_OUT=lo.BLOCK_OUT)
            args = (x, shrunk, B, idx, c.rank, x.shape[1], x.stride(0), *B.stride())
    else:
        kernel = ta._write_kv_kernel
        k = torch.empty(8, c.hkv, c.head_dim, dtype=dtype)  # [T, Hkv, D]
        cache = torch.empty(4, 16, c.hkv, c.head_dim, dtype=dtype)
        slots = torch.zeros(8, dtype=torch.int64)
        args = (k, k, cache, cache, slots, k.stride(0), k.stride(0))
        row = c.hkv * c.head_dim
        constexprs = dict(ROW=row, ROW_PADDED=ta._next_pow2(row))

    target = GPUTarget("cuda", c.arch, 32)
    backend = make_backend(target)
    # Triton's launch binder: (type, specialisation) per argument, as kernel[grid](...) sees them.
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, _ = binder(*args, **constexprs)
    signature = {name: s[0] for name, s in zip(bound, spec)}
    consts = {name: bound[name] for name, ty in signature.items() if ty == "constexpr"}
    attrs = {(i,): backend.parse_attr(s[1]) for i, s in enumerate(spec) if s[0] != "constexpr" and s[1]}

    knobs = getattr(triton, "knobs", None)
    nvidia = getattr(knobs, "nvidia", None)
    if nvidia is not None and hasattr(nvidia, "dump_ptxas_log"):
        nvidia.dump_ptxas_log = True  # ptxas -v's report, printed to stdout
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(kernel, signature, consts, attrs), target=target)
    except Exception as e:  # any compiler error is this config's result, reported
        root = e  # a CompilationError says where ("at 93:12:" and the source); its cause says what
        while root.__cause__ is not None:
            root = root.__cause__
        lines = str(root).strip().splitlines() or [""]
        if lines[0].startswith("at ") and len(lines) > 1:  # no cause: the reason is its message's last line
            lines = [lines[-1]]
        what = lines[0][:200]
        where = str(e).split(":\n")[0] if root is not e or what != str(root).strip() else ""
        return Result(c, error=f"{type(root).__name__}: {what}" + (f" ({where})" if where.startswith("at ") else ""))
    result = Result(c, shared=compiled.metadata.shared)
    for line in log.getvalue().splitlines():
        words = line.split()
        if "registers," in words:  # "ptxas info : Used 80 registers, used 1 barriers, ..."
            result.registers = int(words[words.index("registers,") - 1])
        if "spill" in words:  # "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
            result.spills = sum(int(words[i - 2]) for i, w in enumerate(words) if w == "spill")
    return result


def _worker() -> None:
    configs = [Config(**c) for c in json.load(sys.stdin)]
    results = [_compile_one(c) for c in configs]
    json.dump([{k: v for k, v in asdict(r).items() if k != "config"} for r in results], sys.stdout)


def table(results: list[Result]) -> str:
    """A markdown table, a column per target. Attention: a row per shape x dtype (x tile), its
    two block sizes in one cell (registers as a range); write_kv: a row per dtype, all shapes."""
    archs = sorted({r.config.arch for r in results})
    groups: dict[tuple, dict[int, list[Result]]] = {}
    for r in results:
        c = r.config
        shape = f"{c.shape} ({c.hq}/{c.hkv}/{c.head_dim})" if c.kernel == "attention" else "all of them"
        tile = str(c.tile) if c.kernel == "attention" else "-"
        kernel = f"{c.kernel} ({c.kv} KV)" if c.kv else c.kernel
        groups.setdefault((kernel, shape, tile, c.dtype), {}).setdefault(c.arch, []).append(r)

    def cell(rs: list[Result]) -> str:
        if not rs:
            return ""
        if any(r.error for r in rs):
            return "**fails**: " + next(r.error for r in rs if r.error)
        regs = [r.registers for r in rs]
        regs_text = "?" if None in regs else "-".join(str(n) for n in sorted({min(regs), max(regs)}))
        spills = [r.spills for r in rs]
        spill_text = "?" if None in spills else max(spills)
        over = " **over the limit**" if any(r.over_limit for r in rs) else ""
        return f"{max(r.shared for r in rs) / 1024:.1f} KB, {regs_text} regs, {spill_text} B spilled{over}"

    head = ["kernel", "shape (Hq/Hkv/D)", "tile", "dtype"]
    head += [f"sm_{a} ({GPU_NAMES[a]}; {SMEM_LIMIT[a] // 1024} KB)" for a in archs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, by_arch in groups.items():
        lines.append("| " + " | ".join([*key, *(cell(by_arch.get(a, [])) for a in archs)]) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: one per CPU)")
    args = parser.parse_args(argv)
    if args.worker:
        return _worker()
    configs = grid()
    # The 64-key tile the docs' exercise 1 tries, at the 1B Llama's shape: what a wider tile costs.
    llama = [c for c in configs if c.kernel == "attention" and c.shape == "Llama-3.2-1B" and c.block_size == 16]
    configs += [replace(c, tile=64) for c in llama]
    import triton

    print(f"triton {triton.__version__}, {len(configs)} compiles\n")
    print(table(compile_all(configs, args.jobs)))


if __name__ == "__main__":
    main()
