# Source this on the GPU machine (the `device` tool) before any command of one's own:
#   . scripts/device_env.sh; python3 bench/ffn_bench.py ...
# It installs the carried wheels and the package and exports what the records need, so that a
# command outside scripts/device_run.sh (which sources it too) records the right commit.
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1
# The tree's commit travels in bench/.commit (carried, ignored): the device's copy may hold a
# stale .git, which twellsparse._environment.git_commit would otherwise read (the thirtieth
# session's ad-hoc records said e33a4a7-dirty for a tree at bcdac7d).
if [ -z "${TWELL_COMMIT:-}" ] && [ -f bench/.commit ]; then export TWELL_COMMIT=$(cat bench/.commit); fi
# The device image has no cffi (the cuSPARSE/cuBLASLt bindings need it) and no internet: carry
# its wheels in .whl/ (see docs/ARCHITECTURE.md, "Layout", scripts/) and they are installed here.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | tail -3
