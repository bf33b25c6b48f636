# Sourced by scripts/gpu_check.sh and tools/gpu_ab.sh (GPU machine): FlashInfer's wheels from
# .anchors/ (carried with the tree) installed into /tmp/anchors.
#   anchors_setup WARM   sets anchors=(--anchors /tmp/anchors) when they installed (else empty);
#                        with WARM=1 also starts FlashInfer's JIT builds in the background
#                        (benchmarks/harness/anchors.py, ~2 min of nvcc, log in
#                        $OUT/anchors_warm.log) and sets warm_pid, so that they run beside the
#                        other builds.
anchors_setup() {
  anchors=()
  warm_pid=
  compgen -G ".anchors/*.whl" > /dev/null || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/anchors \
    .anchors/*.whl && anchors=(--anchors /tmp/anchors)
  if [ ${#anchors[@]} -gt 0 ] && [ "$1" = 1 ]; then
    PYTHONPATH=/tmp/anchors python3 -m benchmarks.harness.anchors --anchors /tmp/anchors \
      > "$OUT/anchors_warm.log" 2>&1 &
    warm_pid=$!
  fi
}
