#!/usr/bin/env bash
# One device lease's GPU checks, most important first, each under its own time limit so a slow step costs only
# itself:
# - the CUDA tests;
# - gpu_decode.py's rows: the no-offload ceiling, the default stack (ours on CUDA) and the LRU stack at three
#   budgets, with the routing trace, its routers and the local cost profile for `hybrid-moe simulate`;
# - ours as `simulate --save-ours` tuned it on the fourth lease's trace and profile (benchmarks/measured/), beside
#   the default's fixed settings, at budgets 0.25 and 0.5 (off by default: the fifth lease's one row, at 0.25, ran
#   slower than the default). Since 2026-11-30 the tuning picks ours' cost-aware cache (decay 0.8, horizon 8),
#   simulated 1.07x / 1.03x the default's window at 0.25 / 0.5: TUNED_S=170 measures it;
# - what the graph's fills and CPU round trips cost, and whether the CPU share and fills beside it compete for the
#   host's memory (graph_costs.py; the first two measured 2026-11-28);
# - a profiled prefill of the default and the ring in halves (8 and 16 buffers) at budget 0.25 (the host time split
#   by the dispatch's named ranges);
# - the CPU kernels' tests at the levels this machine's CPU has and the development boxes may lack (AVX-512, AMX),
#   the bf16 lanes and the prompt attention among them;
# - the paper stacks' live rows (off by default, measured in earlier leases; on an H200, 2026-11-27, the three
#   took ~130 s, so PAPERS_S=60 gets one).
# Logs and records go to $OUT (the device tool's folder) or ./gpu-out: eight files, the most the device tool
# brings back. The default limits add up to 600 s, one device call; a limit of 0 skips its step, except MACHINE_S,
# the first step's, which builds the kernel (a build cut short leaves a lock the later steps wait on: keep it ample).
#
#     bash benchmarks/gpu_checks.sh   # LAYERS=8 MACHINE_S=120 TEST_S=150 MAIN_S=170 TUNED_S=0 GRAPH_S=40 PREFILL_S=60 ISA_S=60 PAPERS_S=0
set -u -o pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
rm -f "$out"/{machine,tests,main,prefill}.txt  # the steps add to their logs: a rerun into ./gpu-out starts afresh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/thm-cache}
layers=${LAYERS:-8}
common=(--layers "$layers" --graph on --tokens 32 --prompt 512 4096 --repeats 2 --json)
# the machine, and what the CPU kernel measured on it: the lane starts and whether its prompt attention beat SDPA
# (building the kernel here, before the tests' workers would all wait for one build)
machine() {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    lscpu | grep -E "Model name|^CPU\(s\)|Flags"
    python -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
    timeout "${MACHINE_S:-120}" python -c "from torch_hybrid_moe.ops import cpu_kernel, prefill_attention as p
print('lane starts', cpu_kernel.lane_starts(), 'prompt attention on the op:', p.available())"
}
[ -n "${PARSE_ONLY:-}" ] || { machine >"$out/machine.txt" 2>&1 && head -4 "$out/machine.txt"; }
step() {  # step LIMIT_S LOG COMMAND...: run COMMAND under LIMIT_S seconds (0: skip it), its output added to $out/LOG
    local limit=$1 log=$2
    shift 2
    [ "$limit" -gt 0 ] || return 0
    if [ -n "${PARSE_ONLY:-}" ]; then  # gpu_decode.py's lines printed, for the test suite to parse (no GPU)
        [ "$2" != benchmarks/gpu_decode.py ] || { printf gpu_decode.py && printf ' %q' "${@:3}" && echo; } >&2
        return
    fi
    timeout "$limit" "$@" 2>&1 | tee -a "$out/$log"
}
# -v names each test as it ends: a run cut short by its limit still says which failed (2026-11-27's did not);
# --timeout (pytest-timeout, on the device box) fails a test that hangs with its traceback, before the step's limit
# cuts pytest off ahead of its FAILURES section (2026-11-28); -rP prints what passing tests printed: each
# scheduler's placement time inside a graph
step "${TEST_S:-150}" tests.txt python -m pytest -v -rP -n 12 --timeout 150 -p no:cacheprovider \
    tests/test_cuda.py tests/test_cuda_graph.py tests/test_triton_kernels.py |
    grep -E "FAILED|ERROR|Timeout|[0-9]+ (passed|failed)| us'"
step "${MAIN_S:-170}" main.txt python benchmarks/gpu_decode.py "${common[@]}" --rows gpu hybrid lru \
    --budgets 0.25 0.5 1.0 --trace "$out/trace.safetensors" | grep -v -e "^{" -e Warn
# the rows' cost profile, for simulate --profile (none where its fit was doubted: the rows' warnings say why)
cp "$XDG_CACHE_HOME"/torch_hybrid_moe/profile-deepseek-v2-lite-*.json "$out"/ 2>/dev/null || echo "no cost profile cached"
step "${TUNED_S:-0}" main.txt python benchmarks/gpu_decode.py "${common[@]}" --rows --budgets 0.25 0.5 \
    --stack-file benchmarks/measured/2026-11-28-gpu-h200/ours-tuned-cost-aware.json | grep -v -e "^{" -e Warn
step "${GRAPH_S:-40}" main.txt python benchmarks/graph_costs.py  # fills, CPU round trips, and the two together
step "${PREFILL_S:-60}" prefill.txt python benchmarks/gpu_decode.py --layers "$layers" --graph on --tokens 4 \
    --prompt 512 4096 --repeats 1 --rows hybrid stream-8 stream-16 --budgets 0.25 --profile /tmp/gpu-checks-profile |
    grep -E "tok/s|Error|^---|hybrid_moe::|Name"
# On this box's CPU (2026-11-28) the kernel's refusals of bad operands crashed their processes: each refusal test
# alone in a fresh process, then after an AMX test in the same one (does the AMX route leave something broken?),
# with the dense GEMM's refusal (a literal message) as a control; then the kernels' other tests at this CPU's levels,
# named as they end. Where the first refusal crashes, cuda-gdb (the box has no gdb) prints the C-level backtrace.
kernel_tests() {
    local rc
    local -a runs=(
        "tests/test_cpu_kernel.py::test_kernel_rejects_bad_operands"
        "tests/test_cpu_kernel.py::test_amx_route_refuses_what_it_cannot_run"
        "tests/test_dense_linear.py::test_matvecs_refuses_mixed_formats_and_misshapen_biases"
        "tests/test_dense_linear.py::test_many_row_route_refuses_bad_operands"
        "tests/test_cpu_kernel.py::test_amx_route_over_column_chunks_and_token_blocks[bfloat16] tests/test_cpu_kernel.py::test_kernel_rejects_bad_operands"
    )
    for run in "${runs[@]}"; do
        read -r -a ids <<<"$run"
        python -X faulthandler -m pytest -p no:xdist -p no:cacheprovider -q --tb=line "${ids[@]}" >/tmp/kernel-test.log 2>&1
        rc=$?
        echo "rc $rc: $run"
        [ $rc -eq 0 ] || grep -E "Fatal|Error|error" /tmp/kernel-test.log | head -3
        if [ $rc -ge 128 ] && [ -z "${traced:-}" ] && command -v cuda-gdb >/dev/null; then
            traced=1
            timeout 60 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt -ex "info sharedlibrary" \
                --args python -m pytest -p no:xdist -p no:cacheprovider -q "${ids[@]}" >/tmp/kernel-gdb.log 2>&1
            grep -E "^#|signal|stdc\+\+|gomp|gcc_s" /tmp/kernel-gdb.log | head -40
        fi
    done
    local -a skip=()
    for run in "${runs[@]::4}"; do skip+=(--deselect "$run"); done
    python -m pytest -v -n 8 -p no:cacheprovider "${skip[@]}" tests/test_cpu_kernel.py tests/test_dense_linear.py \
        tests/test_cpu_attention.py tests/test_prefill_attention.py | grep -E "FAILED|ERROR|Fatal|node down|[0-9]+ (passed|failed)"
}
export -f kernel_tests  # `timeout` runs programs, not shell functions
step "${ISA_S:-60}" tests.txt bash -c kernel_tests
step "${PAPERS_S:-0}" main.txt python benchmarks/gpu_decode.py "${common[@]}" --rows dali hybrimoe all-cpu \
    --budgets 0.25 | grep -v -e "^{" -e Warn
