#!/usr/bin/env bash
# The GPU check, as one script for a lent GPU machine (the project's `device` tool): done within 420 s on a
# fresh machine with one H100 or H200 and only torch, triton, transformers, pytest and hypothesis (and what
# they bring), nothing downloaded. It is not a test suite (tests/ is) and not a calibration: it runs each
# part once where CUDA is real and brings back every figure.
#   1. the Triton kernels' native tests, compiled for real (tests/test_level1_kernel.py -k native: attention
#      and the cache write in fp16, bf16 and fp32, and the attention over an int8 and an fp8 KV cache; the
#      file's CPU and interpreter tests are CI's, and would not fit the kernel step's 120 s);
#   2. python -m benchmarks.sim.gpu_check (its docstring lists the parts): prompt logprobs, sampled
#      speculative decoding and structured outputs on CUDA; a random-weight 1B Llama in bf16 through the
#      benchmark (HF and levels 0-3) with the what-if's uncalibrated prediction beside each measured row.
#      Every part fails soft (one line, and the next runs), and one whose package is absent is skipped in a line.
# Everything lands in $OUT, which the device tool brings back: gpu_check.json (every figure, the one file
# docs/what_if.md cites), measured.json (the benchmark's own), the logs. The model (2.5 GB) is deleted on any
# exit, a timeout or an error included.
#
# Time: the whole script keeps to GPU_CHECK_TOTAL (400 s): the kernel tests get at most
# GPU_CHECK_KERNEL_TIMEOUT (120 s), gpu_check what is left less 10 s, and gpu_check's own clock (--budget,
# 15 s less again) skips or cuts its parts to finish before its `timeout` would kill it.
#   run(command="bash benchmarks/sim/gpu_check.sh", carry=[".wheels"], timeout_s=450)
#
# Packages the device lacks come as wheels, made here (Python 3.12, x86-64, as the device's) and carried:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       -d .wheels llguidance==1.9.1
# llguidance needs nothing more and is enough for structured outputs (1.9.1 is the version tested here; pip
# matches each manylinux_2_N exactly); xgrammar would need apache-tvm-ffi's and pydantic's wheels beside it.
# When the folder (GPU_CHECK_WHEELS) holds wheels they are installed from it alone (--no-index --find-links,
# --no-deps: exactly what was carried) into a temporary folder put first on PYTHONPATH. Nothing is fetched
# at run time.
#
# A dry run on a CPU (the plumbing, a small model; tests/test_gpu_check.py runs it with only the device's
# packages importable): GPU_CHECK_ARGS="--device cpu --small" OUT=/tmp/gc bash benchmarks/sim/gpu_check.sh
# Knobs (environment): OUT (/tmp/gpu-check), GPU_CHECK_ARGS (gpu_check's flags), GPU_CHECK_TOTAL,
# GPU_CHECK_KERNEL_TIMEOUT, GPU_CHECK_KERNEL_TESTS (pytest's arguments, default tests/test_level1_kernel.py -k native),
# GPU_CHECK_WHEELS (.wheels).
set -u
out=${OUT:-/tmp/gpu-check}
total=${GPU_CHECK_TOTAL:-400}
wheels=${GPU_CHECK_WHEELS:-.wheels}
mkdir -p "$out"
site="" child=""
# Unbuffered: a step killed at its limit still leaves every line it printed. Offline: the device has no
# network, and a hub lookup would wait for one before it failed.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

cleanup() {  # on every exit: the models are not worth bringing back, and a timeout must not leave one
    rm -rf -- "$out"/llama-*
    if [ -n "$site" ]; then rm -rf -- "$site"; fi
}
on_signal() {  # stop the running step first (its `timeout` passes the signal on), then leave through cleanup
    if [ -n "$child" ]; then kill -TERM "$child" 2>/dev/null; wait "$child" 2>/dev/null; fi
    exit 143
}
trap cleanup EXIT
trap on_signal TERM INT HUP

# limited SECONDS LOG COMMAND...: COMMAND under `timeout` (KILL 5 s after its TERM), its output in LOG.
# In the background and waited for: a signal interrupts `wait` at once, where a foreground command would
# hold this script's traps until it ended.
limited() {
    local secs=$1 log=$2
    shift 2
    timeout -k 5 "$secs" "$@" > "$log" 2>&1 &
    child=$!
    wait "$child"
    local rc=$?
    child=""
    return "$rc"
}

if compgen -G "$wheels/*.whl" > /dev/null; then
    site=$(mktemp -d)
    limited 30 "$out/wheels.txt" python -m pip install --no-index --find-links "$wheels" --no-deps --no-compile \
        --target "$site" "$wheels"/*.whl
    echo "wheels: exit $? ($(cd "$wheels" && ls -- *.whl | tr '\n' ' '))"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
limited 10 "$out/gpu.txt" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi" >> "$out/gpu.txt"
limited 20 "$out/versions.txt" python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
cat "$out/versions.txt"

# -p no:xdist -o addopts=: one process, whatever pytest plugins the machine has
kernel_secs=$(( ${GPU_CHECK_KERNEL_TIMEOUT:-120} < total - SECONDS - 30 ? ${GPU_CHECK_KERNEL_TIMEOUT:-120} : total - SECONDS - 30 ))
# shellcheck disable=SC2086  # GPU_CHECK_KERNEL_TESTS is a list of pytest's arguments
limited "$(( kernel_secs > 1 ? kernel_secs : 1 ))" "$out/kernel_tests.txt" python -m pytest -q -p no:xdist \
    -p no:cacheprovider -o addopts= -ra ${GPU_CHECK_KERNEL_TESTS:-tests/test_level1_kernel.py -k native}
kernel_rc=$?
echo "kernel tests: exit $kernel_rc ($(tail -1 "$out/kernel_tests.txt"))"

secs=$(( total - SECONDS - 10 ))  # 10: this script's last lines and the model's deletion
if [ "$secs" -lt 20 ]; then
    echo "gpu_check: skipped, $secs s left of $total"
    exit 1
fi
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of flags (after --budget: a --budget there wins)
limited "$secs" "$out/gpu_check.txt" python -m benchmarks.sim.gpu_check --out "$out" --budget $(( secs - 15 )) \
    --kernel-log "$out/kernel_tests.txt" --kernel-rc "$kernel_rc" ${GPU_CHECK_ARGS:-}
rc=$?
echo "gpu_check: exit $rc$( [ "$rc" -ge 124 ] && echo " (timed out after $secs s)")"
if grep -q "^== gpu_check summary" "$out/gpu_check.txt"; then
    sed -n '/^== gpu_check summary/,$p' "$out/gpu_check.txt"
else  # cut short: the parts that finished, and the end of the log
    grep "^part " "$out/gpu_check.txt"
    tail -15 "$out/gpu_check.txt"
fi
echo "total: $SECONDS s"
exit $(( kernel_rc != 0 || rc != 0 ))
