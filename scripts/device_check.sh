#!/usr/bin/env bash
# The GPU checks of quantized weights, as one call of the device tool for a session lent a GPU
# (CI has none; `status` says whether a session has one):
#
#     run(command="bash scripts/device_check.sh", timeout_s=540)
#
# That machine has torch, transformers, pytest and msgpack, not hivemind, and starts bare, so this
# runs only what needs neither the network nor a conftest: tests/unit/test_quantized_linear.py with
# BLOOMPEER_TEST_DEVICE=cuda (int8 through CUDA's _int_mm, 4-bit through CUDA's own packing and
# kernel, alone and inside BLOOM and Qwen3 spans, forward and backward), then the kernel table
# (bfloat16, float32, int8, 4-bit against the weights' read floor) and the demo model's perplexity
# on the GPU (benchmarks/quantization.py --device cuda). Logs land in $OUT (or /tmp/device_check).
set -uo pipefail
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/gpu.txt"

BLOOMPEER_TEST_DEVICE=cuda timeout 240 python3 -m pytest --noconftest -p no:cacheprovider -q -rs \
    tests/unit/test_quantized_linear.py 2>&1 | tee "$out/tests.txt"
tests=${PIPESTATUS[0]}

timeout 240 python3 benchmarks/quantization.py --device cuda --repeats 100 2>&1 | tee "$out/benchmark.txt"
benchmark=${PIPESTATUS[0]}

echo "tests exit $tests, benchmark exit $benchmark" | tee -a "$out/gpu.txt"
exit $((tests != 0 || benchmark != 0))
