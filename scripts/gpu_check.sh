#!/usr/bin/env bash
# One command for the GPU machine: build, verify the kernels, run the gpu-marked tests and the
# benchmarks, print a short table last.   Usage (repo root): bash scripts/gpu_check.sh [flags]
#   --only=A,B,...  run only these steps (names below), in this script's order
#   --dry-run       print the steps that would run and exit
#   --no-verify     skip scripts/gpu_verify.py (~4 min; `pytest -m gpu` checks the same ops)
#   --no-bench      skip every benchmark
#   --no-attention  skip benchmarks/bench_attention.py
#   --no-migration  skip benchmarks/bench_migration.py
#   --no-arena      skip benchmarks/bench_arena_map.py
#   --no-serve      skip examples/llama/run.py and benchmarks/bench_{manager_overhead,decode_step,serve}.py
#   --full-serve    the serving benchmark's full seed run (2,500 requests) instead of --quick
#   --pytest=ARGS   the gpu pytest step's arguments instead of the whole gpu suite (e.g.
#                   --pytest="ops/test_attention.py -k ragged")
#   --attention=ARGS  extra arguments for benchmarks/bench_attention.py (e.g. --attention="--only decode")
#   --workers=N     the gpu pytest step on N xdist workers (pytest-xdist: from .whl/ when carried)
#   --pytest-timeout=S  stop the gpu pytest step after S seconds (the later steps still run)
#   --kernel-ab=TAR the kab step: a base snapshot (git archive -o TAR REV) built beside this tree,
#                   its prefill and decode (bf16, fp8) timed against ours in turns (tools/prefill_ab.py)
#   --kab=ARGS      the kab step's prefill_ab arguments instead of --decode --rounds 2 (e.g.
#                   --kab="--decode --rounds 5 --cases 'decode bf16 B=256 S=256'")
#   --serve=ARGS    the serve step's arguments instead of the seed workload's default
#                   (add --time-budget S under the device's 10-minute limit: runs that would
#                   end past S seconds are skipped and the summary still prints)
#   --decode=ARGS   the decode step's arguments (benchmarks/bench_decode_step.py) instead of
#                   --batch 64 256 --context 1536
#   --mixed=ARGS    the mixed step's arguments (benchmarks/bench_mixed_step.py) instead of
#                   trtllm-bench's mixed step (459 decode rows at 1,500 + a 2,048-token chunk, FP8)
#   --spec=ARGS     the spec step's arguments (benchmarks/bench_speculate.py; default: its own)
#   --cascade=ARGS  the cascade step's arguments (benchmarks/bench_cascade.py; default: its own)
#   --gemm=ARGS     the gemm step's arguments (benchmarks/bench_fp8_gemm.py; default: its own)
#   --stepmem=ARGS  the stepmem step's arguments (tools/step_memory.py; default: its own)
# Anchors: with a .anchors/ folder of wheels in the repo root (see benchmarks/harness/anchors.py), they
# are installed into /tmp/anchors, FlashInfer's JIT cache is warmed in the background from the
# start (benchmarks/harness/anchors.py, ~2 min of nvcc beside the build and the tests), and the attention
# benchmark and the profile step measure them side by side with ours.
# Steps: verify pytest kab attention profile migration arena run manager decode mixed serve http
#   handoff spec cascade gemm stepmem tbench
#   (mixed: benchmarks/bench_mixed_step.py, a mixed step (decode rows + a prompt chunk) against
#   its parts alone; off unless named.)
#   (gemm: benchmarks/bench_fp8_gemm.py, the 8B layer's FP8 GEMMs through XLA against cuBLASLt
#   called directly (torch); off unless named.)
#   (tbench: benchmarks/serve.py --workload trtllm-bench --quick with FP8 weights (static
#   activation scales, as TensorRT-LLM's FP8 checkpoints) and K/V at the largest concurrency
#   memory allows, TensorRT-LLM's published protocol; off unless named; --tbench=ARGS replaces
#   its arguments.)
#   (stepmem: tools/step_memory.py, XLA's memory analysis of the 8B serving step (does it copy
#   the pools?), compile only, in the background beside the other steps; off unless named.)
#   (profile: Nsight Compute over tools/decode_profile.py at B256 S1024, ours and, with the
#   anchors, FlashInfer's; ours with fp8 K/V at B64 S4096, with its per-instruction (SASS) stall
#   samples as CSV; tools/prefill_profile.py at B8 S2048 causal; off unless named in --only)
#   (http: benchmarks/bench_serve_http.py --quick; it needs fastapi/uvicorn: with no network, install
#   them first from a wheel folder, e.g. `pip install --no-index --find-links DIR fastapi uvicorn`).
#   (handoff: benchmarks/bench_handoff.py, a sequence's K/V between two managers on the GPU;
#   spec: benchmarks/bench_speculate.py, speculative vs plain decoding, 8B-shaped; cascade:
#   benchmarks/bench_cascade.py, shared-prefix decode attention vs plain, op and 8B decode step;
#   all three off unless named in --only)
# One ~10-minute call fits about: build (~45 s) and pytest (964 tests, ~8 min: 625 ran in 300 s
# on 2026-12-03), or build, serve --quick (~3.5 min) and the benchmarks.
# Logs and JSON results go to $OUT (default /tmp/kvcm_out); the profile step's reports go into
# $OUT/profile.tgz, and at exit every other file into $OUT/logs.tgz (the device tool brings
# back at most 8 files; the tables printed last are the summary).
set -uo pipefail
OUT=${OUT:-/tmp/kvcm_out}
mkdir -p "$OUT"
# shellcheck source=scripts/_bundle_logs.sh
source "$(dirname "$0")/_bundle_logs.sh"
trap 'bundle_logs profile.tgz' EXIT
export PYTHONUNBUFFERED=1
declare -A want=([verify]=1 [pytest]=1 [kab]=0 [attention]=1 [profile]=0 [migration]=1 [arena]=1
                 [run]=1 [manager]=1 [decode]=1 [mixed]=0 [serve]=1 [http]=0 [handoff]=0 [spec]=0
                 [cascade]=0 [gemm]=0 [stepmem]=0 [tbench]=0)
workers=0
pytest_timeout=0
kab_tar=
kab_args=
serve_args=
decode_args=
mixed_args=
spec_args=
cascade_args=
stepmem_args=
gemm_args=
tbench_args=
serve_size=--quick
pytest_args=.
attention_args=
dry_run=0
for arg in "$@"; do
  case "$arg" in
    --only=*)
      for k in "${!want[@]}"; do want[$k]=0; done
      IFS=, read -ra picked <<< "${arg#--only=}"
      for k in "${picked[@]}"; do
        [ -n "${want[$k]+x}" ] || { echo "unknown step $k"; exit 2; }
        want[$k]=1
      done ;;
    --no-verify) want[verify]=0 ;;
    --no-bench) for k in attention migration arena run manager decode serve http; do want[$k]=0; done ;;
    --no-attention) want[attention]=0 ;;
    --no-migration) want[migration]=0 ;;
    --no-arena) want[arena]=0 ;;
    --no-serve) for k in run manager decode serve; do want[$k]=0; done ;;
    --full-serve) serve_size= ;;
    --pytest=*) pytest_args=${arg#--pytest=} ;;
    --attention=*) attention_args=${arg#--attention=} ;;
    --workers=*) workers=${arg#--workers=} ;;
    --pytest-timeout=*) pytest_timeout=${arg#--pytest-timeout=} ;;
    --kernel-ab=*) kab_tar=${arg#--kernel-ab=}; want[kab]=1 ;;
    --kab=*) kab_args=${arg#--kab=} ;;
    --serve=*) serve_args=${arg#--serve=} ;;
    --decode=*) decode_args=${arg#--decode=} ;;
    --mixed=*) mixed_args=${arg#--mixed=} ;;
    --spec=*) spec_args=${arg#--spec=} ;;
    --cascade=*) cascade_args=${arg#--cascade=} ;;
    --stepmem=*) stepmem_args=${arg#--stepmem=} ;;
    --gemm=*) gemm_args=${arg#--gemm=} ;;
    --tbench=*) tbench_args=${arg#--tbench=} ;;
    --dry-run) dry_run=1 ;;
    *) echo "unknown flag $arg"; exit 2 ;;
  esac
done
if [ $dry_run = 1 ]; then
  for k in verify pytest kab attention profile migration arena run manager decode mixed serve \
           http handoff spec cascade gemm stepmem tbench; do
    [ ${want[$k]} = 1 ] && echo "would run: $k"
  done
  echo "serve size: ${serve_size:-full}"
  exit 0
fi
t0=$SECONDS
# shellcheck source=scripts/_anchors_setup.sh
source scripts/_anchors_setup.sh
warm=0
{ [ ${want[attention]} = 1 ] || [ ${want[profile]} = 1 ]; } && warm=1
anchors_setup $warm
# A warm machine keeps /tmp: the extension built from the same sources by an earlier call is
# reused (its stamp is a hash of every file the build reads), saving ~45 s of device time.
stamp=$(find jax_kvcm ffi CMakeLists.txt pyproject.toml -type f -not -path "*/__pycache__/*" -print0 | sort -z \
        | xargs -0 sha1sum | sha1sum | cut -c1-40)
if [ "$(cat /tmp/site/.kvcm_build_stamp 2>/dev/null)" = "$stamp" ]; then
  echo "build: reused /tmp/site (same sources)"
else
  rm -rf /tmp/site
  python3 -m pip install --no-build-isolation --no-deps --target /tmp/site . > "$OUT/build.log" 2>&1 \
    || { tail -50 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
  echo "$stamp" > /tmp/site/.kvcm_build_stamp
  echo "build: $((SECONDS - t0)) s"
fi
if [ ${want[kab]} = 1 ]; then  # the base snapshot, built in the background beside the tests
  rm -rf /tmp/kab_src /tmp/site_base && mkdir -p /tmp/kab_src && tar xf "$kab_tar" -C /tmp/kab_src
  (cd /tmp/kab_src && python3 -m pip install --no-build-isolation --no-deps --target /tmp/site_base . \
     > "$OUT/build_base.log" 2>&1) &
  kab_pid=$!
fi
if [ -d .whl ]; then  # carried wheels (e.g. pytest-xdist): no network on the GPU machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/wheels .whl/*.whl > "$OUT/wheels.log" 2>&1 || tail -5 "$OUT/wheels.log"
  export PYTHONPATH=/tmp/wheels${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
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
# The tests and small benchmarks allocate on demand (the arena maps CUDA VMM memory outside
# XLA's pool); the 8B serving runs preallocate (see below).
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ ${want[stepmem]} = 1 ]; then  # compiles only (CPU-bound): beside the other steps
  t_stepmem=$SECONDS
  # shellcheck disable=SC2086  # stepmem_args is a list of words
  python3 -m tools.step_memory $stepmem_args --json "$OUT/step_memory.json" \
    > "$OUT/step_memory.log" 2>&1 &
  stepmem_pid=$!
fi
if [ ${want[verify]} = 1 ]; then
  step verify verify.log python3 scripts/gpu_verify.py
  grep -E "FAIL|gpu_verify|seed" "$OUT/verify.log" | tail -40
fi
if [ ${want[pytest]} = 1 ]; then
  xdist=; [ "$workers" -gt 0 ] && xdist="-n $workers"
  limit=; [ "$pytest_timeout" -gt 0 ] && limit="timeout $pytest_timeout"
  step pytest-gpu pytest_gpu.log $limit bash -c "cd tests && python3 -m pytest -v --tb=short -m gpu -p no:cacheprovider -rf --rootdir=. $xdist $pytest_args"
  grep -E "FAILED|ERROR" "$OUT/pytest_gpu.log" | head -20; tail -3 "$OUT/pytest_gpu.log"
fi
if [ ${want[kab]} = 1 ]; then
  wait "$kab_pid" || { tail -30 "$OUT/build_base.log"; echo "BASE BUILD FAILED"; }
  # eval: kab_args may quote a case name with spaces
  eval "kab_words=(${kab_args:---decode --rounds 2})"
  step kernel-ab kernel_ab.log python3 -m tools.prefill_ab /tmp/site_base /tmp/site "${kab_words[@]}"
  tail -8 "$OUT/kernel_ab.log"
fi
if [ ${want[attention]} = 1 ] && [ -f benchmarks/bench_attention.py ]; then
  [ -n "${warm_pid:-}" ] && wait "$warm_pid" && tail -7 "$OUT/anchors_warm.log"
  # shellcheck disable=SC2086  # attention_args is a list of words
  step attention bench.log python3 -m benchmarks.bench_attention --no-pallas-sweep "${anchors[@]}" \
    $attention_args --json "$OUT/attention.json"
  tail -45 "$OUT/bench.log"
fi
if [ ${want[profile]} = 1 ]; then
  [ -n "${warm_pid:-}" ] && wait "$warm_pid"
  ncu_sections=(--section SpeedOfLight --section WarpStateStats --section SchedulerStats
                --section Occupancy --section MemoryWorkloadAnalysis --section LaunchStats)
  step ncu-ours ncu_ours.txt ncu --clock-control none -k regex:PagedDecode --launch-skip 2 \
    --launch-count 1 "${ncu_sections[@]}" python3 -m tools.decode_profile
  if [ ${#anchors[@]} -gt 0 ]; then
    step ncu-flashinfer ncu_flashinfer.txt ncu --clock-control none --launch-skip 2 \
      --launch-count 1 -k regex:BatchPrefill "${ncu_sections[@]}" \
      python3 -m tools.decode_profile --method flashinfer "${anchors[@]}"
  fi
  step ncu-fp8 ncu_fp8.txt ncu --clock-control none -k regex:PagedDecode --launch-skip 2 \
    --launch-count 1 --set full --import-source no -o /tmp/ncu_fp8 -f \
    python3 -m tools.decode_profile --fp8 --batch 64 --context 4096
  ncu -i /tmp/ncu_fp8.ncu-rep >> "$OUT/ncu_fp8.txt" 2>&1
  ncu -i /tmp/ncu_fp8.ncu-rep --page source --print-source sass --csv > "$OUT/ncu_fp8_sass.csv" 2>&1
  # The short-context and batch-1 rows, bf16 and fp8: the decode kernel and, when split, the
  # combine (--launch-skip 2 skips the first call's kernels either way).
  for shape in "256 256" "1 131072"; do
    read -r b ctx <<< "$shape"
    for kv in bf16 fp8; do
      flag=; [ $kv = fp8 ] && flag=--fp8
      step "ncu-$kv-B$b-S$ctx" "ncu_${kv}_B${b}_S${ctx}.txt" ncu --clock-control none \
        -k regex:'PagedDecode|CombineSplits' --launch-skip 2 --launch-count 2 "${ncu_sections[@]}" \
        python3 -m tools.decode_profile $flag --batch "$b" --context "$ctx"
    done
  done
  step ncu-prefill ncu_prefill.txt ncu --clock-control none -k regex:RaggedPrefill --launch-skip 2 \
    --launch-count 1 "${ncu_sections[@]}" python3 -m tools.prefill_profile
  grep -hE "^  [A-Z]|Duration|DRAM Throughput|L2 Cache Throughput|L2 Hit Rate|Eligible Warps|Registers Per|Achieved Occupancy" \
    "$OUT"/ncu_*.txt | head -120
  # One archive, not ten files: the device tool returns only a few files from $OUT.
  (cd "$OUT" && tar czf profile.tgz ncu_*.txt ncu_*.csv && rm -f ncu_*.txt ncu_*.csv)
fi
if [ ${want[migration]} = 1 ] && [ -f benchmarks/bench_migration.py ]; then
  step migration migration.log python3 -m benchmarks.bench_migration --json "$OUT/migration.json"
  tail -45 "$OUT/migration.log"
fi
if [ ${want[arena]} = 1 ] && [ -f benchmarks/bench_arena_map.py ]; then
  step arena-map arena_map.log python3 -m benchmarks.bench_arena_map --json "$OUT/arena_map.json"
  tail -12 "$OUT/arena_map.log"
fi
if [ ${want[run]} = 1 ]; then  # the README's main job on the GPU
  step run.py llama_run.log python3 -m examples.llama.run
  tail -25 "$OUT/llama_run.log"
fi
if [ ${want[manager]} = 1 ]; then
  step manager manager.log python3 -m benchmarks.bench_manager_overhead
  tail -10 "$OUT/manager.log"
fi
if [ ${want[decode]} = 1 ]; then
  # shellcheck disable=SC2086  # decode_args is a list of words
  step decode-step decode_step.log python3 -m benchmarks.bench_decode_step \
    ${decode_args:---batch 64 256 --context 1536} --json "$OUT/decode_step.json"
  grep -E "^\| |^GEMMs of" "$OUT/decode_step.log" | tail -24
fi
if [ ${want[mixed]} = 1 ]; then
  # NOTE: one preallocated region, as the serve step: growing region by region, trtllm-bench's
  # mixed step (two 21 GiB FP8 caches) ran out of memory on an H100 (2026-12-07).
  # shellcheck disable=SC2086  # mixed_args is a list of words
  step mixed-step mixed_step.log env XLA_PYTHON_CLIENT_PREALLOCATE=true python3 \
    -m benchmarks.bench_mixed_step \
    ${mixed_args:---decode-rows 459 --context 1500 --chunk 2048 --quantize fp8 \
    --static-input-scales 256 --kv-dtype fp8} --json "$OUT/mixed_step.json"
  grep -E "^\| |^mixed /|checked" "$OUT/mixed_step.log" | tail -12
fi
if [ ${want[serve]} = 1 ] && [ -f benchmarks/bench_serve.py ]; then
  # NOTE: one preallocated arena for the 8B runs. With XLA_PYTHON_CLIENT_PREALLOCATE=false the
  # allocator grows region by region and the second 32 GiB pool of a 256-sequence run did not
  # fit (H200, 2026-11-30: RESOURCE_EXHAUSTED with 48 GiB in use).
  # shellcheck disable=SC2086  # serve_args is a list of words
  step serve serve.log env XLA_PYTHON_CLIENT_PREALLOCATE=true python3 -m benchmarks.serve \
    ${serve_args:---workload trtllm $serve_size --no-check --no-dense} --json "$OUT/serve.json"
  grep -E "^\| " "$OUT/serve.log" | tail -40
fi
if [ ${want[http]} = 1 ] && [ -f benchmarks/bench_serve_http.py ]; then
  step serve-http serve_http.log env XLA_PYTHON_CLIENT_PREALLOCATE=true python3 \
    -m benchmarks.bench_serve_http --quick --json "$OUT/serve_http.json"
  tail -12 "$OUT/serve_http.log"
fi
if [ ${want[handoff]} = 1 ]; then
  step handoff handoff.log python3 -m benchmarks.bench_handoff --json "$OUT/handoff.json"
  grep -E "^\| |handoff on" "$OUT/handoff.log" | tail -8
fi
if [ ${want[spec]} = 1 ]; then
  # shellcheck disable=SC2086  # spec_args is a list of words
  step spec spec.log env XLA_PYTHON_CLIENT_PREALLOCATE=true python3 -m benchmarks.bench_speculate \
    $spec_args --json "$OUT/spec.json"
  grep -E "^\| |^speculative" "$OUT/spec.log" | tail -8
fi
if [ ${want[cascade]} = 1 ]; then
  # shellcheck disable=SC2086  # cascade_args is a list of words
  step cascade cascade.log env XLA_PYTHON_CLIENT_PREALLOCATE=true python3 -m benchmarks.bench_cascade \
    $cascade_args --json "$OUT/cascade.json"
  grep -E "^\| |groups of" "$OUT/cascade.log" | tail -8
fi
if [ ${want[gemm]} = 1 ]; then
  # shellcheck disable=SC2086  # gemm_args is a list of words
  step gemm gemm.log python3 -m benchmarks.bench_fp8_gemm $gemm_args --json "$OUT/gemm.json"
  grep -E "^\| " "$OUT/gemm.log" | tail -80
fi
if [ ${want[tbench]} = 1 ]; then
  # shellcheck disable=SC2086  # tbench_args is a list of words
  step tbench tbench.log env XLA_PYTHON_CLIENT_PREALLOCATE=true python3 -m benchmarks.serve \
    ${tbench_args:---workload trtllm-bench --quick --quantize fp8 --static-input-scales 256 \
      --kv-dtype fp8 --no-check} \
    --json "$OUT/tbench.json"
  grep -E "^concurrency|^\| |RESOURCE" "$OUT/tbench.log" | tail -12
fi
if [ ${want[stepmem]} = 1 ]; then
  wait "$stepmem_pid"; rc=$?
  [ $rc -ne 0 ] && status=1
  summary+=("$(printf '%-14s rc=%-3s %5d s  %s' stepmem "$rc" "$((SECONDS - t_stepmem))" step_memory.log)")
  tail -30 "$OUT/step_memory.log"
fi
echo
echo "step           rc     time  log (in \$OUT)"
printf '%s\n' "${summary[@]}"
echo "total $((SECONDS - t0)) s, status $status"
exit $status
