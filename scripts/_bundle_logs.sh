# Sourced by scripts/gpu_check.sh and tools/gpu_ab.sh (GPU machine). The device tool brings
# back at most 8 files from $OUT, so a run's logs leave in one archive:
#   bundle_logs KEEP...   moves every file in $OUT but logs.tgz and the KEEP names into
#                         $OUT/logs.tgz
bundle_logs() {
  local keep files
  keep=$(printf '%s|' logs.tgz "$@")
  mapfile -t files < <(cd "$OUT" && ls | grep -vxE "${keep%|}")
  [ ${#files[@]} -gt 0 ] || return 0
  (cd "$OUT" && tar czf logs.tgz -- "${files[@]}" && rm -f -- "${files[@]}")
}
