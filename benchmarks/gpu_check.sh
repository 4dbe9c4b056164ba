#!/usr/bin/env bash
# What a GPU machine allows within 8 minutes (issue 17). Without CUDA: "skipped: no GPU", exit 0.
#
#   1 GPU:   rrfp-run --check at pp 1 on CUDA; the CUDA-event receive completion (exec/comm/cuda_recv.py) in one
#            process over a loopback transport; the byte model against torch.cuda.max_memory_allocated
#            (benchmarks/gpu_check.py events|bytes)
#   >= 2:    also NCCL P2P --check at pp 2 (event receives, then RRFP_CUDA_RECV=thread) and the torch
#            baseline comparison (--baseline torch:1F1B); with 1 GPU these print "skipped: 1 GPU"
#
# Each step has its own time limit (together 8 minutes); the exit status is 1 if any step failed.
#     benchmarks/gpu_check.sh            (PYTHON=... to use another interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RUN=("$PY" -m rrfp.exec)

gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)') || {
    echo "gpu_check: cannot import torch with $PY"
    exit 1
}
if [ "$gpus" -eq 0 ]; then
    echo "skipped: no GPU"
    exit 0
fi
"$PY" -c 'import torch; print("gpu_check:", torch.__version__, "CUDA", torch.version.cuda, "|", torch.cuda.get_device_name(0), "x", torch.cuda.device_count())'

failed=0
step() {  # step SECONDS NAME COMMAND...: run it under a time limit, say ok or FAILED with its time
    local limit=$1 name=$2 start code
    shift 2
    echo "== $name"
    start=$(date +%s)
    timeout --kill-after 10 "$limit" "$@"
    code=$?
    if [ "$code" -eq 0 ]; then
        echo "ok: $name ($(($(date +%s) - start)) s)"
    else
        echo "FAILED: $name (exit $code after $(($(date +%s) - start)) s)"
        failed=1
    fi
}

step 100 "rrfp-run --check, pp 1, CUDA" "${RUN[@]}" --gpus 1 --backend nccl --check --hint 1f1b --iterations 2
step 60 "CUDA-event receive completion, one process, loopback" "$PY" benchmarks/gpu_check.py events
step 60 "byte model vs torch.cuda.max_memory_allocated" "$PY" benchmarks/gpu_check.py bytes
if [ "$gpus" -ge 2 ]; then
    step 90 "NCCL P2P --check, pp 2, CUDA-event receives" "${RUN[@]}" --gpus 2 --backend nccl --check --iterations 2
    step 80 "NCCL P2P --check, pp 2, receiver threads" \
        env RRFP_CUDA_RECV=thread "${RUN[@]}" --gpus 2 --backend nccl --check --iterations 2
    step 90 "torch baseline comparison, pp 2" "${RUN[@]}" --gpus 2 --backend nccl \
        --trials fixed/1f1b,rrfp/1f1b --baseline torch:1F1B --iterations 6
else
    echo "skipped: 1 GPU"
fi
exit "$failed"
