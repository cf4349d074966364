#!/usr/bin/env bash
# The GPU check, as one script for a lent GPU machine (the project's `device` tool; under 8 minutes on an H200):
#   1. the Triton kernel's tests, compiled for real (tests/test_level1_kernel.py: on CUDA no interpreter, and the
#      native-GPU tests in fp16, bf16 and fp32 run instead of skipping);
#   2. python -m benchmarks.sim.gpu_check: a random-weight 1B Llama in bf16 through the benchmark (HF and levels
#      0-3), and the what-if's uncalibrated prediction of the same run (levels 0, 2, 3) beside it.
# Everything lands in $OUT (the device tool brings that folder back).
#
# The device has torch, triton, transformers, pytest and hypothesis, and no network: the rest comes as wheels,
# made here and carried with the working tree:
#   pip download -q --only-binary=:all: -d .wheels rich    (recent transformers bring rich along already)
#   run(command="bash benchmarks/sim/gpu_check.sh", carry=[".wheels"], timeout_s=480)
# A dry run on a CPU (the plumbing, small model): GPU_CHECK_ARGS="--device cpu --small" bash benchmarks/sim/gpu_check.sh
set -u
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
if [ -d .wheels ]; then
    python -m pip install -q --no-index --find-links .wheels rich 2>&1 | tail -2
fi
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi") > "$out/gpu.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" \
    | tee -a "$out/gpu.txt"
# -p no:xdist -o addopts=: one process, whatever pytest plugins the machine has
timeout 240 python -m pytest -q -p no:xdist -p no:cacheprovider -o addopts= -ra tests/test_level1_kernel.py \
    > "$out/kernel_tests.txt" 2>&1
echo "kernel tests: exit $? ($(tail -1 "$out/kernel_tests.txt"))"
# shellcheck disable=SC2086  # GPU_CHECK_ARGS is a list of flags
timeout 330 python -m benchmarks.sim.gpu_check --out "$out" ${GPU_CHECK_ARGS:-} > "$out/gpu_check.txt" 2>&1
echo "gpu_check: exit $?"
grep -A40 "^measured on" "$out/gpu_check.txt" || tail -30 "$out/gpu_check.txt"
rm -rf "$out"/llama-* # the model (about 2 GB) is not worth bringing back
