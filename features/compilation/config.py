"""`compilation_config`: what `LLM(..., compilation_config=...)` and `enforce_eager=` take, checked.

What it is: `CompilationConfig`, vLLM's names where they exist, and `parse`, which turns the
setting's forms into one (a `ValueError` naming the field on a bad one):

    compilation_config=None            the engine's default: 3 on a CPU (level 5: on every rank), 0 on a GPU and
                                       with batch_invariant=True (level1_paged/engine.py's CompilationSettings)
    compilation_config=0               eager: the model runs as written
    compilation_config=3               torch.compile, vLLM's "piecewise" level, every default below
    compilation_config={"level": 3, "cudagraph_capture_sizes": [1, 2, 4, 8], ...}
    enforce_eager=True                 eager whatever compilation_config says (vLLM's switch)

    level                    0: eager; 3: Dynamo traces the model once, Inductor compiles it
    backend                  "inductor" (fused C++ on a CPU, Triton on a GPU) or "eager" (Dynamo's
                             graph run by PyTorch as traced: no compiler, seconds to build; to see
                             the graphs, and for tests)
    splitting_ops            the ops the graph is split at, each piece compiled alone; None: the
                             attention op on a GPU (CUDA graphs need attention outside them), none
                             on a CPU (one graph: the pieces' boundaries cost 2-4 % there, measured)
    cudagraph_capture_sizes  the token counts a batch is padded up to, one static graph each
                             (a batch above the largest runs unpadded); None: vLLM's sizes up to
                             max_capture_size on a GPU, none on a CPU (one graph with a symbolic
                             token count: padding 33 tokens to 64 cost 0.81x there, measured)
    max_capture_size         the largest default capture size (vLLM: 512)
    use_cudagraph            capture each size's pieces as CUDA graphs (on a GPU only, and only with
                             the graph split at attention: with splitting_ops=[] nothing is captured)
    inductor_compile_config  Inductor settings while it compiles (`torch._inductor.config`); None:
                             {"cpp_wrapper": True} on a CPU (the code that calls the kernels in
                             C++ too, not Python: 2.43 against 2.67 ms a decode step at batch 1,
                             measured; a cold compile 44 s against 38 s), nothing on a GPU

FROZEN_GEMM, an `inductor_compile_config` for a CPU, not the default: the weights frozen into the graph
as constants (Inductor's `freezing`) and its own GEMMs (`max_autotune` with the "CPP" GEMM template:
AVX-512 or AVX2 micro-kernels, the weights packed for them once at compile time) tried beside ATen's
(oneDNN/MKL) for every linear, the faster kept. On a 2-core AMD EPYC, where MKL's matmuls run far
below the core's rate, it made a decode step 2.4x the compiled default's at batch 1 and 1.3x at 64
(docs/compiled_step.md, `python -m benchmarks.compiled_step`). Not the default, for three reasons:
every start compiles again (the frozen weights' oneDNN copies cannot be pickled, so Inductor's on-disk
cache is bypassed, pytorch issue 139783: about 30 s a start for the built-in model, against seconds
from the cache); the packed copies keep more sets of the linear weights in memory; and a frozen
graph does not see weights that change after it is built (nothing in the ladder changes them: LoRA
and quantized models run eager).

    LLM(model, compilation_config={"inductor_compile_config": FROZEN_GEMM})

What it is not: vLLM's whole config (no custom passes, no `compile_sizes` beside the capture
sizes), or the compiler (runner.py, piecewise.py).

Reference: vLLM `vllm/config/compilation.py` (`CompilationConfig`, `CompilationLevel`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

EAGER, PIECEWISE = 0, 3  # vLLM's CompilationLevel.NO_COMPILATION and .PIECEWISE
# the weights as constants and Inductor's own GEMMs beside ATen's (the module docstring; Inductor's tutorial
# "Max-autotune Support on CPU with GEMM Template"): an inductor_compile_config for a CPU
# (Inductor still writes each GEMM's timings to stderr while it compiles)
FROZEN_GEMM = {
    "cpp_wrapper": True,
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "max_autotune_report_choices_stats": False,
}
BACKENDS = ("inductor", "eager")
SPLITTING_OPS = ("ladder.attention",)  # the custom ops a graph may be split at (attention_op.py)


@dataclass
class CompilationConfig:
    level: int = EAGER
    backend: str = "inductor"
    splitting_ops: list[str] | None = None
    cudagraph_capture_sizes: list[int] | None = None
    max_capture_size: int = 512
    use_cudagraph: bool = True
    inductor_compile_config: dict | None = None

    def __post_init__(self):
        if self.level not in (EAGER, PIECEWISE):
            raise ValueError(f"compilation_config level={self.level!r} must be 0 (eager) or 3 (compiled, "
                             "vLLM's piecewise level; levels 1 and 2 are not built)")  # fmt: skip
        if self.backend not in BACKENDS:
            raise ValueError(f"compilation_config backend={self.backend!r} must be one of {', '.join(BACKENDS)}")
        if self.splitting_ops is not None:
            bad = [op for op in self.splitting_ops if op not in SPLITTING_OPS]
            if bad:
                raise ValueError(f"compilation_config splitting_ops {bad} are not ops of this engine; it has: "
                                 f"{', '.join(SPLITTING_OPS)}")  # fmt: skip
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (not all(isinstance(s, int) and s >= 1 for s in sizes)):
            raise ValueError(f"compilation_config cudagraph_capture_sizes={sizes!r} must be whole numbers >= 1")
        if self.max_capture_size < 1:
            raise ValueError(f"compilation_config max_capture_size={self.max_capture_size} must be >= 1")

    @property
    def compiled(self) -> bool:
        return self.level == PIECEWISE

    def capture_sizes(self, device_type: str) -> list[int]:
        """The sizes a batch is padded up to, ascending ([] on a CPU unless given)."""
        if self.cudagraph_capture_sizes is not None:
            return sorted(set(self.cudagraph_capture_sizes))
        if not self.graphs_captured(device_type):  # padding buys nothing without graphs to replay
            return []
        # vLLM's default list: 1, 2, 4, then every multiple of 8 up to the largest
        return [s for s in [1, 2, 4, *range(8, self.max_capture_size + 1, 8)] if s <= self.max_capture_size]

    def inductor_settings(self, device_type: str) -> dict:
        if self.inductor_compile_config is not None:
            return dict(self.inductor_compile_config)
        return {"cpp_wrapper": True} if device_type == "cpu" else {}

    def split_at(self, device_type: str) -> list[str]:
        """The ops the graph is split at (see the module docstring)."""
        if self.splitting_ops is not None:
            return list(self.splitting_ops)
        return list(SPLITTING_OPS) if device_type == "cuda" else []

    def graphs_captured(self, device_type: str) -> bool:
        """Whether pieces are captured as CUDA graphs: on a GPU, compiled by Inductor, and only when the
        graph is split at attention (a graph with attention inside would replay the warm-up's attention,
        which wrote nothing, at every step: attention must run outside the captured pieces)."""
        return (self.compiled and self.use_cudagraph and device_type == "cuda" and self.backend == "inductor"
                and "ladder.attention" in self.split_at(device_type))  # fmt: skip


def parse(value, enforce_eager: bool = False) -> CompilationConfig:
    """`compilation_config=` (None, a level, a dict of the fields, or a CompilationConfig) -> one config."""
    if isinstance(value, CompilationConfig):
        config = value
    elif value is None:
        config = CompilationConfig()
    elif isinstance(value, int) and not isinstance(value, bool):
        config = CompilationConfig(level=value)
    elif isinstance(value, dict):
        known = {f.name for f in fields(CompilationConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"compilation_config has no field(s) {', '.join(unknown)}; it takes: {', '.join(sorted(known))}"
            )
        # a dict asks for compilation unless it says level 0
        config = CompilationConfig(**{"level": PIECEWISE, **value})
    else:
        raise ValueError(f"compilation_config={value!r} must be a level (0 or 3), a dict of its fields, or None")
    if enforce_eager:
        return CompilationConfig(**{**{f.name: getattr(config, f.name) for f in fields(config)}, "level": EAGER})
    return config


__all__ = ["CompilationConfig", "parse", "EAGER", "FROZEN_GEMM", "PIECEWISE", "SPLITTING_OPS"]
