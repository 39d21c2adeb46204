#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck (warp and block barriers reached by every
# thread they name) over every twellsparse kernel (scripts/sanitize_smoke.py);
# CuPy's own kernels (kns=cupy_) are excluded: racecheck flags warnings inside its nonzero scan.
set -uo pipefail
status=0
python3 scripts/sanitize_smoke.py >/dev/null  # warm the kernel cache outside the sanitizer
for tool in memcheck racecheck synccheck; do
  echo "== compute-sanitizer --tool $tool"
  log=$(mktemp)
  compute-sanitizer --tool "$tool" --kernel-name-exclude kns=cupy_ --error-exitcode 3 python3 scripts/sanitize_smoke.py >"$log" 2>&1
  rc=$?
  tail -5 "$log"
  # On a failure, the sanitizer's first reports (which kernel, which access) and the Python error.
  if [ "$rc" -ne 0 ]; then grep -E "^=========|Error|error" "$log" | grep -v TwELLFallbackWarning | head -60; fi
  rm -f "$log"
  echo "exit $rc"
  status=$((status | rc))
done
exit $status
