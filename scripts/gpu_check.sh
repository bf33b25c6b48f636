#!/usr/bin/env bash
# One command for the GPU machine: build, verify the kernels, run the gpu-marked tests and the
# benchmarks, print a short table last.   Usage (repo root): bash scripts/gpu_check.sh [flags]
#   --no-verify     skip scripts/gpu_verify.py (~4 min; `pytest -m gpu` checks the same ops)
#   --no-bench      skip every benchmark
#   --no-attention  skip benchmarks/attention.py
#   --no-migration  skip benchmarks/migration.py
#   --no-arena      skip benchmarks/arena_map.py
#   --no-serve      skip examples/llama/run.py and benchmarks/{manager_overhead,decode_step,serve}.py
# Logs and JSON results go to $OUT (default /tmp/kvcm_out).
set -uo pipefail
OUT=${OUT:-/tmp/kvcm_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
verify=1 attention=1 migration=1 serve=1 arena=1
for arg in "$@"; do
  case "$arg" in
    --no-verify) verify=0 ;;
    --no-bench) attention=0 migration=0 serve=0 arena=0 ;;
    --no-attention) attention=0 ;;
    --no-migration) migration=0 ;;
    --no-arena) arena=0 ;;
    --no-serve) serve=0 ;;
    *) echo "unknown flag $arg"; exit 2 ;;
  esac
done
t0=$SECONDS
rm -rf /tmp/site
python3 -m pip install --no-build-isolation --no-deps --target /tmp/site . > "$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "build: $((SECONDS - t0)) s"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
summary=()
step() {  # step NAME LOG CMD...: runs CMD, keeps its output in $OUT/LOG, notes rc and seconds
  local name=$1 log=$2; shift 2
  local t=$SECONDS
  "$@" > "$OUT/$log" 2>&1
  local rc=$?
  [ $rc -ne 0 ] && status=1
  summary+=("$(printf '%-14s rc=%-3s %5d s  %s' "$name" "$rc" "$((SECONDS - t))" "$log")")
  return $rc
}
(cd /tmp && python3 -c "import jax, jax_kvcm; print(jax.__version__, jax.devices(), 'cuda ext:', jax_kvcm.cuda_extension_available())")
if [ $verify = 1 ]; then
  step verify verify.log python3 scripts/gpu_verify.py
  grep -E "FAIL|gpu_verify|seed" "$OUT/verify.log" | tail -40
fi
step pytest-gpu pytest_gpu.log bash -c "cd tests && python3 -m pytest -q -m gpu -p no:cacheprovider -x --rootdir=. ."
tail -5 "$OUT/pytest_gpu.log"
if [ $attention = 1 ] && [ -f benchmarks/attention.py ]; then
  step attention bench.log python3 benchmarks/attention.py --no-pallas-sweep --json "$OUT/attention.json"
  tail -45 "$OUT/bench.log"
fi
if [ $migration = 1 ] && [ -f benchmarks/migration.py ]; then
  step migration migration.log python3 benchmarks/migration.py --json "$OUT/migration.json"
  tail -45 "$OUT/migration.log"
fi
if [ $arena = 1 ] && [ -f benchmarks/arena_map.py ]; then
  step arena-map arena_map.log python3 benchmarks/arena_map.py --json "$OUT/arena_map.json"
  tail -12 "$OUT/arena_map.log"
fi
if [ $serve = 1 ]; then  # the README's main job on the GPU, then the serving benchmark
  step run.py llama_run.log bash -c "cd /tmp && python3 $PWD/examples/llama/run.py"
  tail -25 "$OUT/llama_run.log"
  step manager manager.log python3 benchmarks/manager_overhead.py
  tail -10 "$OUT/manager.log"
  step decode-step decode_step.log python3 benchmarks/decode_step.py --batch 64 256 --context 1536 \
    --json "$OUT/decode_step.json"
  tail -8 "$OUT/decode_step.log"
fi
if [ $serve = 1 ] && [ -f benchmarks/serve.py ]; then
  # NOTE: one preallocated arena for the 8B runs. With XLA_PYTHON_CLIENT_PREALLOCATE=false the
  # allocator grows region by region and the second 32 GiB pool of a 256-sequence run did not
  # fit (H200, 2026-11-30: RESOURCE_EXHAUSTED with 48 GiB in use).
  step serve serve.log env XLA_PYTHON_CLIENT_PREALLOCATE=true python3 benchmarks/serve.py \
    --workload trtllm --quick --no-check --json "$OUT/serve.json"
  tail -60 "$OUT/serve.log"
fi
echo
echo "step           rc     time  log (in \$OUT)"
printf '%s\n' "${summary[@]}"
echo "total $((SECONDS - t0)) s, status $status"
exit $status
