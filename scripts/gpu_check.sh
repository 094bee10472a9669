#!/usr/bin/env bash
# One call on a lent GPU machine (the device tool; no network there, so no `make`): the kernel tests natively
# on CUDA, then bench/kernels.py. Logs and JSON go under $OUT (default /tmp/gpu_check).
# Usage, from the repository root: bash scripts/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu_check}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
status=0
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee "$OUT/versions.txt"
$PY -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tee "$OUT/kernel_tests.log" || status=1
$PY bench/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/bench_kernels.log" || status=1
exit $status
