#!/usr/bin/env bash
# The GPU checks, as one call of the device tool for a session lent a GPU (CI has none; `status` says whether
# a session has one). First, here: bash scripts/device_wheels.sh (it fills .whl/). Then:
#
#     run(command="bash scripts/device_check.sh", carry=[".whl"], timeout_s=600)
#     run(command="bash scripts/device_check.sh graphs graph-bench", timeout_s=420)   # issue 42's item 3 alone
#
# Stages, run in this order (name some to run only those); the whole run stops starting stages once 8 minutes
# are spent, each stage's timeout cut to what is left:
#  graphs       tests/device/test_step_graphs_cuda.py: decode steps captured as CUDA graphs and replayed against
#               eager steps in float32 (BLOOM, Llama, Mistral, dynamic rope, DeepSeek-V3's latent block, Qwen3.5's
#               Gated DeltaNet, Mixtral's float32 experts), Mixtral's experts in bfloat16 and int8, greedy tokens
#               through graphed steps against transformers' generate on the GPU, and (with the wheels) a server's
#               scheduler replaying graphs for two sessions' batched steps;
#  graph-bench  benchmarks/step_graphs.py: 24 bloom-560m blocks in bfloat16, a decode step eager and graphed, for
#               1 and 8 sessions, weights as bfloat16, int8 and int4 (goals: graphed <= 2 ms; int8/int4 no slower);
#  tests        tests/unit/test_quantized_linear.py with BLOOMPEER_TEST_DEVICE=cuda: int8 through CUDA's _int_mm,
#               4-bit through CUDA's own packing and kernel, alone and inside BLOOM and Qwen3 spans, forward and
#               backward, and the start-up check of the kernels;
#  kernels      benchmarks/quantization.py --device cuda: the kernel table (bfloat16, float32, int8, 4-bit,
#               against the weights' read floor) and the demo model's perplexity computed on the GPU;
#  servers      with the wheels: benchmarks/quantized_servers.py --device cuda --dtype bfloat16, real servers on
#               the GPU (none, int8, int4) behind a real swarm: perplexity through it, decode, prefill and 8
#               sessions on the bloom-560m shape.
# The machine starts bare, with torch, an older transformers, pytest and msgpack but not hivemind; the wheels in
# .whl/ (if carried) add hivemind and the transformers release setup.cfg requires. Python: a carried .venv's if
# its torch has CUDA, else the machine's python3; the script stops if neither sees a CUDA device. Nothing is
# downloaded. Logs land in $OUT (or /tmp/device_check); the exit status is 0 only if every stage that ran passed.
set -uo pipefail
out=${OUT:-/tmp/device_check}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
BUDGET_S=470  # 8 minutes, less the set-up before the first stage

python=""
for candidate in .venv/bin/python python3; do
    command -v "$candidate" >/dev/null || continue
    if "$candidate" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        python=$candidate
        break
    fi
    echo "$candidate: its torch ($("$candidate" -c 'import torch; print(torch.__version__)' 2>&1 | tail -1)) sees no" \
        "CUDA device (a CPU-only build, or no driver)" | tee -a "$out/gpu.txt"
done
if [[ -z $python ]]; then
    echo "no Python here has a CUDA build of torch that sees a GPU: nothing to check" | tee -a "$out/gpu.txt"
    exit 2
fi

if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | tail -3
    export PYTHONPATH=/tmp/site:$PWD
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee -a "$out/gpu.txt"
"$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
    | tee -a "$out/gpu.txt"

stages=("$@")
[[ ${#stages[@]} -gt 0 ]] || stages=(graphs graph-bench tests kernels servers)
status=()
# run STAGE TIMEOUT_S LOG COMMAND...: the command under the smaller of its timeout and the time left
run() {
    local stage=$1 limit=$2 log=$3 left=$((BUDGET_S - SECONDS))
    shift 3
    if ((left < 30)); then
        echo "$stage: not run, the 8 minutes are spent" | tee -a "$out/gpu.txt"
        return
    fi
    timeout $((limit < left ? limit : left)) "$@" 2>&1 | tee "$out/$log"
    status+=("$stage ${PIPESTATUS[0]}")
}
for stage in "${stages[@]}"; do
    case $stage in
        graphs) run graphs 150 graphs.txt "$python" -m pytest --noconftest -p no:cacheprovider -q -rs -s \
                    tests/device/test_step_graphs_cuda.py ;;
        graph-bench) run graph-bench 240 graph_bench.txt "$python" benchmarks/step_graphs.py --steps 100 ;;
        tests) BLOOMPEER_TEST_DEVICE=cuda run tests 120 tests.txt "$python" -m pytest --noconftest \
                   -p no:cacheprovider -q -rs tests/unit/test_quantized_linear.py ;;
        kernels) run kernels 150 kernels.txt "$python" benchmarks/quantization.py --device cuda --repeats 100 ;;
        servers)
            if "$python" -c "import hivemind" 2>/dev/null; then
                run servers 270 servers.txt "$python" benchmarks/quantized_servers.py --device cuda \
                    --dtype bfloat16 --models bloom-560m --rounds 1
            else
                echo "servers: not run, hivemind is missing (carry .whl, see scripts/device_wheels.sh)" \
                    | tee -a "$out/gpu.txt"
            fi ;;
        *) echo "unknown stage $stage (graphs, graph-bench, tests, kernels, servers)"; exit 2 ;;
    esac
done

echo "exit statuses: ${status[*]}" | tee -a "$out/gpu.txt"
for entry in "${status[@]}"; do
    [[ ${entry##* } == 0 ]] || exit 1
done
