#!/usr/bin/env bash
# Download, on a machine with pip access, the wheels the GPU machine's image lacks (cffi for the
# cuSPARSE / cuBLASLt bindings, and its pycparser) into .whl/; the device run installs them
# (scripts/device_run.sh) when the `run` call carries `.whl`. The image runs CPython 3.12.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl cffi pycparser
ls -l .whl
