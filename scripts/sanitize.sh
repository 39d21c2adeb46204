#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over every kernel (scripts/sanitize_smoke.py).
set -uo pipefail
status=0
python3 scripts/sanitize_smoke.py >/dev/null  # warm the kernel cache outside the sanitizer
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  compute-sanitizer --tool "$tool" --error-exitcode 3 python3 scripts/sanitize_smoke.py 2>&1 | tail -5
  rc=${PIPESTATUS[0]}
  echo "exit $rc"
  status=$((status | rc))
done
exit $status
