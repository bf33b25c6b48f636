#!/usr/bin/env bash
# One command for the GPU machine: build, verify the kernels, run the gpu-marked tests and the
# benchmarks, print a short table last.   Usage (repo root): bash scripts/gpu_check.sh [--no-bench]
# --no-migration (any position) skips only the migration benchmark (benchmarks/migration.py).
set -uo pipefail
OUT=${OUT:-/tmp/kvcm_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
rm -rf /tmp/site
python3 -m pip install --no-build-isolation --no-deps --target /tmp/site . > "$OUT/build.log" 2>&1 \
  || { tail -50 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export XLA_PYTHON_CLIENT_PREALLOCATE=false
status=0
skip_migration=0
for arg in "$@"; do [ "$arg" = "--no-migration" ] && skip_migration=1; done
python3 -c "import jax, jax_kvcm; print(jax.__version__, jax.devices(), 'cuda ext:', jax_kvcm.cuda_extension_available())"
python3 scripts/gpu_verify.py 2>&1 | tee "$OUT/verify.log" | grep -E "FAIL|gpu_verify|seed" | tail -40 || status=1
if [ -d tests ]; then
  (cd tests && python3 -m pytest -q -m gpu -p no:cacheprovider -x --rootdir=. . 2>&1 | tee "$OUT/pytest_gpu.log" | tail -15) || status=1
fi
if [ "${1:-}" = "--variants" ]; then
  python3 scripts/decode_variants.py 2>&1 | tee "$OUT/variants.log" | tail -20
fi
if [ "${1:-}" != "--no-bench" ] && [ -f benchmarks/attention.py ]; then
  python3 benchmarks/attention.py --no-pallas-sweep --json "$OUT/attention.json" 2>&1 \
    | tee "$OUT/bench.log" | tail -45 || status=1
fi
if [ "${1:-}" != "--no-bench" ] && [ "$skip_migration" = 0 ] && [ -f benchmarks/migration.py ]; then
  python3 benchmarks/migration.py --json "$OUT/migration.json" 2>&1 \
    | tee "$OUT/migration.log" | tail -45 || status=1
fi
exit $status
