#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool; no network there, so no `make`), at most 10 minutes. Logs
# and JSON go under $OUT (default /tmp/gpu_check); a summary table is printed last.
#   1. the Triton kernel tests natively on CUDA, and the CUDA-only tests (tests/gpu): greedy tokens equal to
#      transformers for every architecture with 1+1 and 1+3 ranks on one GPU through cuda_ipc, bf16 prompt
#      log-probabilities near transformers' bf16, a seeded request twice;
#   2. bench/kernels.py (decode attention against copy bandwidth, fused MoE against dense matmul);
#   3. per-layer dispatch/combine times through cuda_ipc (launch/comm_profile.py, device-synchronised timers);
#   4. bench/throughput.py on a Qwen3-30B-A3B-shaped checkpoint with a few layers, against HF generate, its KV
#      cache sized by the GPU memory plan;
#   5. the GPU memory plan alone on the GPU (tests/gpu/test_memory_plan.py reads the whole GPU's use);
#   6. decode graphs (not in the default stages): `graphs` runs tests/gpu/test_cuda_graphs.py, `graphs-bench` runs
#      step 4's bench with micro_batches=1 twice, with graphs (the default) and with --enforce-eager; the two fit
#      one call (`bash scripts/gpu_check.sh graphs graphs-bench`, at most 560 s).
#   7. cuda_ipc_events (not in the default stages): `ipc-events` runs tests/gpu/test_cuda_ipc_events.py and step 4's
#      bench with micro_batches=1 without and with it, in one call (at most 520 s).
# Usage, from the repository root: bash scripts/gpu_check.sh [stage ...]
#   (stages: tests kernels comm throughput memory graphs graphs-bench ipc-events; gpu: tests/gpu alone, for a run whose
#   Triton kernels have not changed since their last GPU run)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
PY=${PY:-python3}
STAGES=${*:-tests kernels comm throughput memory}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
declare -A result
run() {   # run NAME SECONDS CMD...: its output to $OUT/NAME.log, its exit status to the summary
    local name=$1 secs=$2; shift 2
    local t0=$SECONDS
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    result[$name]="rc=$rc $((SECONDS - t0))s"
    tail -n 4 "$OUT/$name.log"
}
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$OUT/versions.txt"
for stage in $STAGES; do
    case $stage in
    tests) run tests 330 $PY -m pytest -q -p no:cacheprovider -rfEPs -n 4 tests/kernels tests/gpu \
               --ignore=tests/gpu/test_memory_plan.py ;;
    gpu) run gpu 240 $PY -m pytest -q -p no:cacheprovider -rfEPs -n 8 tests/gpu \
             --ignore=tests/gpu/test_memory_plan.py ;;
    memory) run memory 200 $PY -m pytest -q -p no:cacheprovider -rfEPs -s tests/gpu/test_memory_plan.py ;;
    kernels) run kernels 150 $PY bench/kernels.py --out "$OUT/kernels.json" ;;
    comm) run comm 120 $PY -m launch.comm_profile --device cuda --attention-ranks 1 --expert-ranks 3 \
              --transport cuda_ipc --prompts 32 --prompt-len 128 --max-tokens 32 --out /tmp/comm_profile \
              && cp /tmp/comm_profile/profile.json "$OUT/comm_profile.json" ;;
    throughput) run throughput 300 $PY bench/throughput.py --device cuda --synthetic-layers 4 --requests 128 \
                    --micro-batches 2 --repeats 3 --attention-ranks 1 --expert-ranks 1 --gpu-memory-utilization 0.8 ;;
    graphs) run graphs 220 $PY -m pytest -q -p no:cacheprovider -rfEPs -n 4 tests/gpu/test_cuda_graphs.py ;;
    graphs-bench)
        for mode in graphs eager; do
            run "throughput_$mode" 170 $PY bench/throughput.py --device cuda --synthetic-layers 4 --requests 128 \
                --micro-batches 1 --repeats 2 --attention-ranks 1 --expert-ranks 1 --gpu-memory-utilization 0.8 \
                $([[ $mode == eager ]] && echo --enforce-eager)
        done ;;
    ipc-events)
        run ipc_events_tests 200 $PY -m pytest -q -p no:cacheprovider -rfEPs -n 4 tests/gpu/test_cuda_ipc_events.py
        for mode in sync events; do
            run "throughput_$mode" 160 $PY bench/throughput.py --device cuda --synthetic-layers 4 --requests 128 \
                --micro-batches 1 --repeats 2 --attention-ranks 1 --expert-ranks 1 --gpu-memory-utilization 0.8 \
                $([[ $mode == events ]] && echo --cuda-ipc-events)
        done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
    esac
done
status=0
echo "stage       result"
for name in "${!result[@]}"; do
    printf '%-11s %s\n' "$name" "${result[$name]}"
    [[ ${result[$name]} == rc=0* ]] || status=1
done
exit $status
