#!/bin/bash
# A kernel change against its base, in one call on the GPU machine: builds a base snapshot (A) and
# the working tree (B) side by side, runs gpu tests on B, then times both with
# tools/prefill_ab.py (alternated) and, optionally, B beside FlashInfer / cuDNN.
#
# Here, before the call (the tarball is untracked and not ignored, so it travels with the tree):
#   git archive -o ab_base.tar main          # A: any commit
# On the GPU machine:
#   bash tools/gpu_ab.sh ab_base.tar [--pytest='ARGS'] [--rounds=N] [--attention] [--also=TAR]
#     --pytest=ARGS  gpu tests on B (default: test_nonfinite.py and the ragged attention tests);
#                    --pytest= (empty) skips them
#     --rounds=N     prefill_ab.py turns per build (default 2)
#     --quick        prefill_ab.py at its tiny shapes (a smoke test of this script; CPU too)
#     --fp8          prefill_ab.py also over fp8 K/V caches (the sm90 kernel's fp8 path)
#     --also=TAR     one more snapshot, timed between A and B (repeatable)
#     --test-also    the gpu tests (this tree's tests/) on each --also build too
#     --profile      Nsight Compute (--set full, per-instruction SASS samples as CSV) of A's and
#                    B's sm90 prefill kernel at B8 S2048 causal (in logs.tgz), the time of each
#                    kernel of a call (ncu, one at a time), and B's calls back to back under
#                    jax.profiler (each kernel's time in a loop, the gaps between them)
#     --attention    then benchmarks/bench_attention.py --only prefill on B, with FlashInfer when its
#                    wheels are in .anchors/ (carried; benchmarks/harness/anchors.py)
# Every step's log is in $OUT (written as it goes); at exit they go into $OUT/logs.tgz, and the
# report (tests, times, clock and power, profiles, ratios) and a table of the steps are printed
# last and kept in $OUT/report.md and $OUT/steps.txt.
set -u
base_tar=${1:?usage: gpu_ab.sh BASE_TAR [--pytest=ARGS] [--rounds=N] [--quick] [--fp8] [--also=TAR]... [--test-also] [--profile] [--attention]}
shift
pytest_args="ops/test_nonfinite.py ops/test_attention.py -k 'nonfinite or ragged or prefill'"
rounds=2
attention=0
quick=()
fp8=()
also=()
test_also=0
profile=0
for arg in "$@"; do
  case $arg in
    --pytest=*) pytest_args=${arg#--pytest=} ;;
    --rounds=*) rounds=${arg#--rounds=} ;;
    --attention) attention=1 ;;
    --quick) quick=(--quick) ;;
    --fp8) fp8=(--fp8) ;;
    --also=*) also+=("${arg#--also=}") ;;
    --test-also) test_also=1 ;;
    --profile) profile=1 ;;
    *) echo "unknown argument: $arg"; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_ab}
mkdir -p "$OUT"
rm -f "$OUT/steps.txt"
step() {  # name log command... (a line per step in $OUT/steps.txt, so that steps run side by side)
  local name=$1 log=$2 t0=$SECONDS rc
  shift 2
  "$@" > "$OUT/$log" 2>&1
  rc=$?
  printf '%-12s rc=%-3s %5s s  %s\n' "$name" "$rc" "$((SECONDS - t0))" "$log" >> "$OUT/steps.txt"
  return $rc
}
report() { tee -a "$OUT/report.md"; }  # stdin: lines for the report, printed now and at exit
ROOT=$PWD
# Runs a command of this tree's tools/ against one build: started in the build's folder, so that
# its jax_kvcm comes first on sys.path (python -m puts the working directory first), the repo
# root after it (tools/, benchmarks/).   on_build SITE[:MORE_PATHS] COMMAND...
on_build() { local path=$1; shift; env -C "${path%%:*}" PYTHONPATH="$path:$ROOT" "$@"; }
# At exit: the report and the steps again, last (what a cut-off output keeps), and every log in
# one archive (the device tool brings back at most 8 files).
finish() {
  echo
  echo "==== report"
  cat "$OUT/report.md" "$OUT/steps.txt" 2> /dev/null
  bundle_logs report.md steps.txt
}
# shellcheck source=scripts/_bundle_logs.sh
source scripts/_bundle_logs.sh
trap finish EXIT
rm -f "$OUT/report.md"
# shellcheck source=scripts/_anchors_setup.sh
source scripts/_anchors_setup.sh
anchors=()
# FlashInfer's JIT builds run beside ours
[ $attention = 1 ] || [ $profile = 1 ] && anchors_setup 1
build() { python3 -m pip install --no-build-isolation --no-deps --target "$2" "$1"; }
names=()
sources=()
snapshot() {  # name source (a folder, or a tarball unpacked into /tmp/ab_NAME)
  local src=$2
  if [ -f "$src" ]; then
    src=/tmp/ab_$1
    rm -rf "$src" && mkdir -p "$src" && tar -xf "$2" -C "$src" || exit 1
  fi
  names+=("$1")
  sources+=("$src")
}
snapshot a "$base_tar"
for i in "${!also[@]}"; do snapshot "also$i" "${also[$i]}"; done
snapshot b .
# The builds run side by side: one translation unit (the sm90 prefill) bounds each build's time.
pids=()
for i in "${!names[@]}"; do
  step "build-${names[$i]}" "build_${names[$i]}.log" build "${sources[$i]}" "/tmp/site_${names[$i]}" &
  pids+=($!)
done
sites=()
for i in "${!names[@]}"; do
  wait "${pids[$i]}" || { tail -30 "$OUT/build_${names[$i]}.log"; exit 1; }
  sites+=("/tmp/site_${names[$i]}")
done
gpu_tests() {  # name site (side by side: no preallocation, so that the processes share the GPU)
  step "pytest-$1" "pytest_$1.log" env XLA_PYTHON_CLIENT_PREALLOCATE=false bash -c "cd tests &&
    PYTHONPATH=$2 python3 -m pytest -q -m gpu -p no:cacheprovider -rf --rootdir=. $pytest_args"
  grep -E "FAILED|ERROR|passed|failed|deselected|no tests" "$OUT/pytest_$1.log" | tail -8 |
    sed "s/^/pytest-$1: /" | report
}
if [ -n "$pytest_args" ]; then
  gpu_tests b /tmp/site_b &
  pids=($!)
  if [ $test_also = 1 ]; then
    for i in "${!also[@]}"; do gpu_tests "also$i" "/tmp/site_also$i" & pids+=($!); done
  fi
  wait "${pids[@]}"
fi
# The GPU's SM clock and power while a step runs (read only; settings untouched).
smi_summary() {  # csv of clocks.sm, power.draw: over the samples under load (> 200 W)
  python3 - "$1" <<'PY'
import statistics, sys
rows = [tuple(map(float, l.split(","))) for l in open(sys.argv[1]) if l.count(",") == 1]
load = [r for r in rows if r[1] > 200]
print(f"SM clock under load: min {min(r[0] for r in load):.0f}, median "
      f"{statistics.median(r[0] for r in load):.0f} MHz; power mean "
      f"{statistics.mean(r[1] for r in load):.0f}, max {max(r[1] for r in load):.0f} W "
      f"({len(load)} of {len(rows)} samples)" if load else f"no samples under load ({len(rows)})")
PY
}
watched() {  # name log command...: step, with the clock and power it ran at in the report
  local smi_pid=
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 200 \
      > "$OUT/smi_$1.csv" 2>&1 &
    smi_pid=$!
  fi
  step "$@"
  local rc=$?
  [ -n "$smi_pid" ] && kill "$smi_pid" && echo "$1: $(smi_summary "$OUT/smi_$1.csv")" | report
  return $rc
}
watched prefill-ab prefill_ab.log python3 -m tools.prefill_ab "${sites[@]}" \
  --rounds "$rounds" "${quick[@]}" "${fp8[@]}"
grep -v "^round" "$OUT/prefill_ab.log" | report
if [ $profile = 1 ]; then
  for x in a b; do
    step "ncu-$x" "ncu_prefill_$x.txt" on_build "/tmp/site_$x" ncu --clock-control none \
      -k regex:RaggedPrefillSm90 --launch-skip 2 --launch-count 1 --set full --import-source no \
      -o "/tmp/ncu_prefill_$x" -f python3 -m tools.prefill_profile --batch 8 --context 2048
    ncu -i "/tmp/ncu_prefill_$x.ncu-rep" >> "$OUT/ncu_prefill_$x.txt" 2>&1
    ncu -i "/tmp/ncu_prefill_$x.ncu-rep" --page source --print-source sass --csv \
      > "$OUT/ncu_prefill_${x}_sass.csv" 2>&1
  done
  # Every kernel of a call (XLA's too), one at a time (ncu): A's, B's, FA3's and cuDNN's.
  [ -n "${warm_pid:-}" ] && wait "$warm_pid"
  ncu_times() {  # name site method
    step "ncu-times-$1" "ncu_times_$1.txt" on_build "$2" ncu --clock-control none \
      --metrics gpu__time_duration.sum python3 -m tools.prefill_profile --batch 8 \
      --context 2048 --calls 4 --method "$3" "${anchors[@]}"
    echo "== $1: kernel times (ncu, us)" | report
    grep -E "\(.*\)x\(|gpu__time_duration" "$OUT/ncu_times_$1.txt" | tail -12 |
      sed -E 's/ \(([0-9]+, ){2}[0-9]+\)x\(([0-9]+, ){2}[0-9]+\), Context.*//' | report
  }
  ncu_times a /tmp/site_a ours
  ncu_times b /tmp/site_b ours
  [ ${#anchors[@]} -gt 0 ] && ncu_times fa3 "/tmp/site_b:/tmp/anchors" flashinfer
  ncu_times cudnn /tmp/site_b cudnn
  # B's and cuDNN's calls back to back under jax.profiler: each kernel's time in a loop (against
  # ncu's, one at a time) and the gaps between them (Nsight Systems is not on the GPU machine).
  for m in ours cudnn; do
    step "trace-$m" "trace_$m.log" on_build /tmp/site_b python3 \
      -m tools.prefill_profile --batch 8 --context 2048 --calls 9 --method $m \
      --trace "/tmp/trace_$m"
    { echo "== $m (B's build): back to back (jax.profiler)"
      sed -n '/^compiled ENTRY/,$p' "$OUT/trace_$m.log" | grep -v " parameter(" | tail -40
    } | report
  done
  grep -hE "^  [A-Z]|Duration|Issue Slots Busy|Eligible Warps|No Eligible" "$OUT"/ncu_prefill_?.txt |
    head -40
  # Where each build's warps wait, by role, and by the unit of work an instruction runs once for
  # (tools/sass_regions.py). B8 S2048 causal at G = 4 on 132 CTAs: 4,096 work tiles (256 of
  # them one key tile long), 34,816 key tiles; "inner": neither a work tile's first nor its last.
  units=('work tile=4096' 'work tile or its end claim=4228' 'work tile past its first key tile=3840'
         'key tile=34816' 'key tile past a work tile first=30720' 'inner key tile=26880')
  for x in a b; do
    python3 -m tools.sass_regions "$OUT/ncu_prefill_${x}_sass.csv" --top 12 \
      --units "${units[@]}" > "$OUT/sass_regions_$x.md" 2>&1
    { echo "== $x: stall samples by role"; head -40 "$OUT/sass_regions_$x.md"
      sed -n '/samples by what/,/^$/p' "$OUT/sass_regions_$x.md"; } | report
  done
fi
if [ $attention = 1 ]; then
  [ -n "${warm_pid:-}" ] && wait "$warm_pid"
  watched attention attention.log env PYTHONPATH=/tmp/site_b python3 -m benchmarks.bench_attention \
    --only prefill --no-pallas-sweep "${anchors[@]}"
  sed -n '/^### Ragged prefill/,$p' "$OUT/attention.log" | report
fi
