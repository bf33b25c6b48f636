# Sourced by scripts/gpu_check.sh and scripts/gpu_ab.sh (GPU machine). The device tool brings
# back at most 8 files from $OUT, so a run's logs leave in one archive:
#   bundle_logs KEEP...   moves every file in $OUT but logs.tgz and the KEEP names into
#                         $OUT/logs.tgz
bundle_logs() {
  local keep
  keep=$(printf '%s|' logs.tgz "$@")
  (cd "$OUT" && ls | grep -vxE "${keep%|}" > /tmp/bundle_logs.txt &&
    tar czf logs.tgz -T /tmp/bundle_logs.txt && xargs rm -f < /tmp/bundle_logs.txt)
}
