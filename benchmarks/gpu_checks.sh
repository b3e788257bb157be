#!/usr/bin/env bash
# One device lease's GPU checks, most important first, each under its own time limit so a slow step costs only
# itself: the CUDA tests, then gpu_decode.py's rows (the no-offload ceiling, the default and ours at three
# budgets, with the routing trace and the local cost profile for `hybrid-moe simulate`), then the paper stacks'
# live rows. Logs and records go to $OUT (the device tool's folder) or ./gpu-out.
#
#     bash benchmarks/gpu_checks.sh          # LAYERS=8 TEST_S=200 MAIN_S=250 PAPERS_S=120 by default
set -u -o pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/thm-cache}
layers=${LAYERS:-8}
common=(--layers "$layers" --graph on --tokens 32 --prompt 512 4096 --repeats 2 --json)
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    lscpu | grep -E "Model name|^CPU\(s\)|Flags"
    python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
} >"$out/machine.txt" 2>&1
head -4 "$out/machine.txt"
timeout "${TEST_S:-200}" python -m pytest -q -n 12 -p no:cacheprovider \
    tests/test_cuda.py tests/test_cuda_graph.py tests/test_triton_kernels.py 2>&1 | tee "$out/tests.txt" | tail -25
timeout "${MAIN_S:-250}" python benchmarks/gpu_decode.py "${common[@]}" --rows gpu hybrid ours \
    --budgets 0.25 0.5 1.0 --trace "$out/trace.pt" 2>&1 | tee "$out/main.txt" | grep -v -e "^{" -e Warn
timeout "${PAPERS_S:-120}" python benchmarks/gpu_decode.py "${common[@]}" --rows dali hybrimoe all-cpu \
    --budgets 0.25 2>&1 | tee "$out/papers.txt" | grep -v -e "^{" -e Warn
cp "$XDG_CACHE_HOME"/torch_hybrid_moe/profile-deepseek-v2-lite-*.json "$out"/  # the rows' cost profile, for simulate --profile
