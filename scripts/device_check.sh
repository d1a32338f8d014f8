#!/usr/bin/env bash
# The GPU checks, as one call of the device tool for a session lent a GPU (CI has none; `status`
# says whether a session has one). First, here: bash scripts/device_wheels.sh (it fills .whl/). Then:
#
#     run(command="bash scripts/device_check.sh", carry=[".whl"], timeout_s=600)
#
# That machine starts bare, with torch, an older transformers, pytest and msgpack but not hivemind;
# the wheels in .whl/ (if carried) add hivemind and the transformers release setup.cfg requires.
#  1. tests/unit/test_quantized_linear.py with BLOOMPEER_TEST_DEVICE=cuda: int8 through CUDA's
#     _int_mm, 4-bit through CUDA's own packing and kernel, alone and inside BLOOM and Qwen3 spans,
#     forward and backward, and the start-up check of the kernels;
#  2. benchmarks/quantization.py --device cuda: the kernel table (bfloat16, float32, int8, 4-bit,
#     against the weights' read floor) and the demo model's perplexity computed on the GPU;
#  3. with the wheels: benchmarks/quantized_servers.py --device cuda --dtype bfloat16, real servers
#     on the GPU (none, int8, int4) behind a real swarm: perplexity through it, decode, prefill and
#     8 sessions on the bloom-560m shape.
# Logs land in $OUT (or /tmp/device_check); the exit status is 0 only if every stage that ran passed.
set -uo pipefail
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH=/tmp/site:$PWD
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/gpu.txt"
status=()

BLOOMPEER_TEST_DEVICE=cuda timeout 120 python3 -m pytest --noconftest -p no:cacheprovider -q -rs \
    tests/unit/test_quantized_linear.py 2>&1 | tee "$out/tests.txt"
status+=("tests ${PIPESTATUS[0]}")

timeout 150 python3 benchmarks/quantization.py --device cuda --repeats 100 2>&1 | tee "$out/kernels.txt"
status+=("kernels ${PIPESTATUS[0]}")

if python3 -c "import hivemind" 2>/dev/null; then
    timeout 270 python3 benchmarks/quantized_servers.py --device cuda --dtype bfloat16 --models bloom-560m \
        --rounds 1 2>&1 | tee "$out/servers.txt"
    status+=("servers ${PIPESTATUS[0]}")
fi

echo "exit statuses: ${status[*]}" | tee -a "$out/gpu.txt"
for entry in "${status[@]}"; do
    [[ ${entry##* } == 0 ]] || exit 1
done
