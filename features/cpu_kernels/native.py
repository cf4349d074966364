"""Compiled CPU kernels: a C++ file built once with the system's compiler, loaded with ctypes.

What it is: `NativeLibrary(source, signatures)`, the one way the ladder turns a small C++
file into functions Python can call (this room's `cpu_ops.cpp` and `cpu_attention.cpp`,
`features/batch_invariance/invariant_ops.cpp` and `features/lora/cpu_lora.cpp`). The sources include no torch header (they take raw pointers
and sizes; the one header they share is `bf16.h`, beside this file), so one `c++ -O3 -shared`
call of about a second makes a shared library, named by a hash of the source and the shared
header, the flags, the compiler and the CPU it was built for (`-march=native`:
a library built for one CPU may not run on another that shares the cache folder), in
`$LADDER_CACHE_DIR` (default `~/.cache/inference-ladder`).
The first process that needs it builds it into a temporary name and renames it (atomic:
two processes building at once are harmless); every later one just loads it.

Why not `torch.utils.cpp_extension.load_inline`: compiling against torch's headers takes
about a minute of CPU on 2 cores, too long for a first demo or a test run.

If it cannot be built (no compiler), `available()` is False, the reason is logged once,
and callers choose their plain-torch path: a missing compiler is never an error unless a
caller asks for the kernel by name (`require()` raises with the reason).

The flags: -O3 and -fopenmp-simd let the compiler vectorise the loops marked `#pragma omp
simd` (no OpenMP runtime is linked); -march=native uses the building CPU's instructions
(the cache is per machine); -ffp-contract=off keeps every `a * b + c` two roundings, as
PyTorch's own elementwise ops round, so one loop computes the same bits whether the
compiler vectorised it or not (the batch-invariant kernels depend on that; a library may
add flags: the fixed-order matmul asks for fused multiply-adds); -fno-trapping-math and
-fno-math-errno promise no floating-point traps and no errno, which lets the compiler
turn a branch into a vector select; neither changes a single result.

What it is not: a kernel library or a JIT; no torch tensors cross this file (the callers
pass `data_ptr()`s).

Reference: Python's `ctypes`; `torch.utils.cpp_extension.load_inline`, the heavier way to the same end.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

CFLAGS = [
    "-O3",
    "-march=native",
    "-fopenmp-simd",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-std=c++17",
    "-shared",
    "-fPIC",
]

HEADERS = (Path(__file__).with_name("bf16.h"),)  # what every source may #include (its folder is on -I)

# ctypes codes for `signatures`: p a pointer (data_ptr()), i an int64, d a double; "ppi->i" returns an int64
_CTYPES = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "d": ctypes.c_double}


def cache_dir() -> Path:
    return Path(os.environ.get("LADDER_CACHE_DIR") or Path.home() / ".cache" / "inference-ladder")


def cpu_signature() -> str:
    """What -march=native builds for: the CPU's model name and feature flags (Linux), else the platform's word."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(sorted(set(keep)))


class NativeLibrary:
    """One C++ source, built on first use: `lib.get()` is the ctypes library or None (why: `lib.error`)."""

    def __init__(self, source: Path, signatures: dict[str, str], flags: tuple[str, ...] = ()):
        """signatures: C function name -> argument codes, e.g. {"rms_norm_f32": "ppiidp"}; flags: added to CFLAGS."""
        self.source, self.signatures, self.flags = Path(source), signatures, [*CFLAGS, *flags]
        self.error: str | None = None  # why it could not be built, once tried and failed
        self._lib: ctypes.CDLL | None = None
        self._lock = threading.Lock()  # two threads asking at once build it once
        self._functions: dict = {}  # name -> the loaded library's entry point (`function`)

    def build(self) -> ctypes.CDLL:
        """Compile (unless this exact build is cached) and load; raises on any failure."""
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH")
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
        parts = [self.source.read_text(), *(h.read_text() for h in HEADERS), " ".join(self.flags), version,
                 cpu_signature()]  # fmt: skip
        key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
        path = cache_dir() / f"{self.source.stem}-{key}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
            os.close(fd)
            try:
                include = [f"-I{h.parent}" for h in HEADERS]
                done = subprocess.run([cxx, *self.flags, *include, str(self.source), "-o", tmp], capture_output=True,
                                      text=True)  # fmt: skip
                if done.returncode != 0:
                    raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[:500]}")
                os.chmod(tmp, 0o755)  # mkstemp makes it private: another user sharing the folder could not load it
                os.replace(tmp, path)  # atomic: another process sees no library or a whole one
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(path))
        for name, codes in self.signatures.items():
            args, _, ret = codes.partition("->")
            fn = getattr(lib, name)
            fn.argtypes = [_CTYPES[c] for c in args]
            fn.restype = _CTYPES[ret] if ret else None
        return lib

    def get(self) -> ctypes.CDLL | None:
        """The library, or None (with the reason logged once) if it cannot be built."""
        with self._lock:
            if self._lib is None and self.error is None:
                try:
                    self._lib = self.build()
                except Exception as e:  # noqa: BLE001 -- any build failure means "use the torch path"
                    first = str(e).strip().splitlines()
                    self.error = f"{type(e).__name__}: {first[0] if first else ''}"
                    log.warning("compiled %s unavailable (%s); using the torch path", self.source.name, self.error)
        return self._lib

    def available(self) -> bool:
        return self.get() is not None

    def require(self, asked_for: str) -> ctypes.CDLL:
        """The library, or a RuntimeError naming what asked for it and why it could not be built."""
        lib = self.get()
        if lib is None:
            raise RuntimeError(f"{asked_for}: the compiled kernel could not be built ({self.error})")
        return lib

    def function(self, name: str, asked_for: str):
        """The entry point `name`, looked up once (a step calls a few of them a layer: `require`'s lock and the
        lookup each time would cost more than some of the calls), or `require`'s RuntimeError."""
        fn = self._functions.get(name)
        if fn is None:
            lib = self.require(asked_for)
            fn = getattr(lib, name)
            with self._lock:
                if self._lib is lib:  # (not a library a reset() has just forgotten)
                    self._functions[name] = fn
        return fn

    def reset(self) -> None:
        """Forget the library and any failure (tests: try the build again)."""
        with self._lock:
            self._lib, self.error, self._functions = None, None, {}


__all__ = ["NativeLibrary", "cache_dir", "CFLAGS"]
