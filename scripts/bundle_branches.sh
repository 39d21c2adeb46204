#!/usr/bin/env bash
# Pack branches for one device run: each BRANCH's tree (git archive) and commit into .branches/,
# which the `run` call carries (it is git-ignored: add ".branches" to carry). On the GPU machine
# `bash scripts/device_run.sh branch=NAME:STEP,STEP ...` runs those steps of NAME's own
# device_run.sh in its own unpacked tree (logs and records under $OUT/NAME/) and reinstalls this
# tree afterwards: several untested branches cost one machine start instead of one each.
# Usage: bash scripts/bundle_branches.sh BRANCH...
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.branches/' .git/info/exclude 2>/dev/null || echo '/.branches/' >> .git/info/exclude
rm -rf .branches
mkdir -p .branches
for branch in "$@"; do
  name=${branch//\//_}
  git archive --format=tar.gz -o ".branches/$name.tar.gz" "$branch"
  git rev-parse "$branch" > ".branches/$name.commit"
done
du -sh .branches
