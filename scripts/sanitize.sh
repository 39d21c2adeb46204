#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and synccheck (warp and block barriers reached by every
# thread they name) over every twellsparse kernel (scripts/sanitize_smoke.py);
# CuPy's own kernels (kns=cupy_) are excluded: racecheck flags warnings inside its nonzero scan.
set -uo pipefail
status=0
python3 scripts/sanitize_smoke.py >/dev/null  # warm the kernel cache outside the sanitizer
for tool in memcheck racecheck synccheck; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --kernel-name-exclude kns=cupy_ --error-exitcode 3 python3 scripts/sanitize_smoke.py 2>&1 | tail -5
  rc=${PIPESTATUS[0]}
  echo "exit $rc"
  status=$((status | rc))
done
exit $status
