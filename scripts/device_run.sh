#!/usr/bin/env bash
# One batched run on the GPU machine (the `device` tool): install, GPU tests, demo, benchmarks.
# Writes logs and JSON under $OUT (default ./out). Usage: bash scripts/device_run.sh [branch=NAME:STEP,STEP|branchrows=NAME|tests|demo|bench|training|widths|smallm|wide|widestages|sharedb|wide65536|gatherblocks|gatherblocksmodel|skewedtrain|segments|cuttrace|roworder|hostgap|producerncu|producerclocks|producerenergy|ffnenergy|transposeab|jax|micro|stages|hints|trainprofile|benchquick|profile|hostprofile|hostphases|fp8|minblocks|probe|producerab|modelschedule|producerprobe|stationary|tiled|tiledspmm|tiledquick|tiledwarps|tiledffn|multigpu|multigputests|tiledcheck|halfpack|stationaryhalf|pairs|decoderncu|decodermemory|tmaprobe|tokenstep|ordereda|upab|upncu|tiledbwd|tiledforced|tiledmodel|dual|downchoice|transposedprobe|sanitize|all]...
set -uo pipefail
. "$(dirname "$0")/device_env.sh"  # install, TWELL_COMMIT, PYTHONPATH, $OUT
what=${*:-all}
status=0
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
  python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion())"
} 2>&1 | tee "$OUT/env.txt"
# One GPU test file (stopping at the first failure; a hang ends at the timeout, default 240 s),
# appended to $OUT/<log>.log; its exit status joins the run's. Usage: gpu_test_file FILE LOG [SECONDS
# [PYTEST ARGUMENTS...]]
gpu_test_file() {
  timeout "${3:-240}" python3 -m pytest -m gpu -q -x -p no:cacheprovider "$1" "${@:4}" 2>&1 | tee -a "$OUT/$2.log" | tail -15
  status=$((status | ${PIPESTATUS[0]}))
}
# bench/stage_times.py for the stages named ONLY at each density (and its further ARGUMENTS),
# appended to $OUT/<log>.log and $OUT/stages.jsonl; exit statuses join the run's.
# Usage: stage_rows ONLY "DENSITIES" LOG [ARGUMENTS...]
stage_rows() {
  for d in $2; do
    timeout 200 python3 bench/stage_times.py --density "$d" --only "$1" --out "$OUT/stages.jsonl" "${@:4}" 2>&1 \
      | tee -a "$OUT/$3.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
}
# The tiled up projection's block sizes at the decoder batch (131072 tokens, 0.5%) and at 16384
# tokens, 1%: an A/B row set for kernel variants (settings, branches). Usage: up_ab_rows LOG
up_ab_rows() {
  stage_rows "tiled 768,tiled 800" "0.005" "$1" --m 131072
  stage_rows "tiled 384,tiled 512" "0.01" "$1"
}
# A kernel form behind a setting: FILE's tests named KEYWORD, the whole FILE with SETTING
# (VARIABLE=VALUE) in the environment, then memcheck and racecheck on the tests SANITIZED picks
# (with the setting too), appended to $OUT/<log>.log. Usage: switch_tests FILE LOG KEYWORD SETTING SANITIZED
switch_tests() {
  gpu_test_file "$1" "$2" 240 -k "$3"
  export "${4?}"
  gpu_test_file "$1" "$2" 240
  sanitize_tests "$1" "$5" "$2"
  unset "${4%%=*}"
}
# The stage rows ONLY at 16384 tokens (0.5 / 1%) and 131072 tokens (0.5%) with VARIABLE=32, then
# =16 (a pack's whole-warp and half-warp forms), appended to $OUT/<log>.log.
# Usage: width_rows VARIABLE ONLY LOG
width_rows() {
  local width
  for width in 32 16; do
    echo "$1=$width" | tee -a "$OUT/$3.log"
    export "$1=$width"
    stage_rows "$2" "0.005 0.01" "$3"
    stage_rows "$2" "0.005" "$3" --m 131072 --reps 5
  done
  unset "$1"
}
# The row gathers under the TWELL_GATHER_* settings in the environment (named in the log): their
# stages (" gather", "up sddmm", "bwd sddmm") and one gated plan call's kernels (bench/plan_trace.py)
# at 0.5 / 1%, 16384 tokens, appended to $OUT/<log>.log. Usage: gather_layout_rows LOG
gather_layout_rows() {
  local label
  label=$(env | grep -E "^TWELL_GATHER_(BLOCK_WARPS|ROW_ORDER)=" | sort | tr '\n' ' ')
  echo "$label" | tee -a "$OUT/$1.log"
  stage_rows " gather,up sddmm,bwd sddmm" "0.005 0.01" "$1"
  for d in 0.005 0.01; do
    timeout 100 python3 bench/plan_trace.py --density "$d" 2>&1 \
      | grep -E "plan|gather|row_|stationary_spmm|span" | sed "s/^/$label: /" | tee -a "$OUT/$1.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
}
# compute-sanitizer memcheck and racecheck on the tests of FILE selected by -k EXPR, appended to
# $OUT/<log>.log. Usage: sanitize_tests FILE EXPR LOG
sanitize_tests() {
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 3 python3 -m pytest -m gpu -q -x -p no:cacheprovider \
      "$1" -k "$2" 2>&1 | tail -4 | sed "s/^/$tool  /" | tee -a "$OUT/$3.log"
    status=$((status | ${PIPESTATUS[0]}))
  done
}
# Nsight Compute on one launch of KERNEL (a regex) in bench/stage_times.py's row ROW (at 1% and
# its default tokens unless ARGUMENTS say otherwise): throughput, warp states, shared-memory
# wavefronts and conflicts, instructions (NCU_SECTIONS, when set, replaces those sections and
# metrics); the lines of note to the terminal, all of it to $OUT/<log>_ncu.log.
# Usage: [NCU_SECTIONS="--section ..."] ncu_rows KERNEL ROW LOG [ARGUMENTS...]
ncu_rows() {
  local kernel=$1 row=$2 log=$3
  shift 3
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(--density 0.01)
  # shellcheck disable=SC2086  # NCU_SECTIONS is a list of options
  timeout 150 ncu --kernel-name regex:"$kernel" --launch-skip 3 --launch-count 1 --section SpeedOfLight \
    ${NCU_SECTIONS:---section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    --metrics smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__data_pipe_lsu_wavefronts.sum,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio} \
    python3 bench/stage_times.py "${args[@]}" --reps 3 --only "$row" 2>&1 | tail -150 | tee -a "$OUT/${log}_ncu.log" \
    | grep -E "Duration|Throughput|Issued|Stall|stalled|wavefronts|conflicts|sectors|inst_executed|Eligible" | head -50
}
# A branch packed by scripts/bundle_branches.sh unpacked into TREE (a fresh directory); a
# missing pack is logged and fails the run. Usage: unpack_branch NAME TREE
unpack_branch() {
  if [ ! -f ".branches/$1.tar.gz" ]; then
    echo "branch $1: .branches/$1.tar.gz missing (bundle_branches.sh, carry .branches)" | tee -a "$OUT/branches.log"
    status=1
    return 1
  fi
  rm -rf "$2" && mkdir -p "$2" && tar -xzf ".branches/$1.tar.gz" -C "$2"
}
for step in $what; do
  case $step in
    branch=*)
      # branch=NAME:STEP,STEP: those steps of a branch packed by scripts/bundle_branches.sh, in
      # its own tree and with its own device_run.sh (logs under $OUT/NAME), then this tree again.
      spec=${step#branch=}
      name=${spec%%:*}
      steps=${spec#*:}
      here=$PWD
      tree=/tmp/branches/$name
      unpack_branch "$name" "$tree" || continue
      (cd "$tree" && TWELL_COMMIT=$(cat "$here/.branches/$name.commit") OUT="$OUT/$name" \
        bash scripts/device_run.sh ${steps//,/ }) 2>&1 | tee -a "$OUT/branches.log" | tail -40
      status=$((status | ${PIPESTATUS[0]}))
      python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | tail -3
      continue
      ;;
    branchrows=*)
      # branchrows=NAME: the tiled product's stage rows (A/B of kernel versions; any commit packed
      # by bundle_branches.sh) in NAME's unpacked tree, records under $OUT/NAME, then this tree.
      name=${step#branchrows=}
      here=$PWD
      tree=/tmp/branches/$name
      unpack_branch "$name" "$tree" || continue
      mkdir -p "$OUT/$name"
      (cd "$tree" && python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | tail -3
        for d in 0.005 0.01 0.02; do
          TWELL_COMMIT=$(cat "$here/.branches/$name.commit") timeout 200 python3 bench/stage_times.py --density "$d" \
            --only "down spmm, tiled, packed" --out "$OUT/$name/stages.jsonl"
        done) 2>&1 | tee -a "$OUT/branches.log" | grep -E "tiled|Error|error" | tail -12
      python3 -m pip install --no-deps --no-build-isolation -q -e . 2>&1 | tail -3
      continue
      ;;
  esac
  case $step in
    tests|all)
      python3 -m pytest -m gpu -q --maxfail=40 --durations=10 -p no:cacheprovider ${TWELL_TESTS:-} 2>&1 | tee "$OUT/pytest_gpu.log" | tail -40
      status=$((status | ${PIPESTATUS[0]}))
      ;;&
    demo|all)
      python3 -m twellsparse demo --json "$OUT/demo.jsonl" 2>&1 | tee "$OUT/demo.log"
      status=$((status | ${PIPESTATUS[0]}))
      ;;&
    bench|all)
      python3 bench/ffn_bench.py --out "$OUT/ffn_bench.jsonl" 2>&1 | tee "$OUT/ffn_bench.log"
      status=$((status | ${PIPESTATUS[0]}))
      ;;&
    training|bench|all)
      # The training step and the model (eager and captured in CUDA graphs); `training` alone
      # skips the FFN benchmark.
      python3 bench/train_step.py --out "$OUT/train_step.jsonl" 2>&1 | tee "$OUT/train_step.log"
      status=$((status | ${PIPESTATUS[0]}))
      python3 bench/model_bench.py --out "$OUT/model_bench.jsonl" 2>&1 | tee "$OUT/model_bench.log"
      status=$((status | ${PIPESTATUS[0]}))
      ;;&
    widths|all)
      # The other widths of the issue and the M sweep (uniform and skewed, 0.25-5% density).
      # Main and auto rows only, densities around the crossings too (the break-even data).
      # Skewed as well at 4096 tokens, where the sparse path's fixed costs weigh most.
      for shape in "--m 4096 --patterns uniform,skewed" "--d-model 4096 --d-ff 14336 --m 4096 --patterns uniform" \
        "--d-model 4096 --d-ff 14336 --m 16384 --patterns uniform" "--m 16384 --patterns uniform" \
        "--m 65536 --patterns uniform"; do
        python3 bench/ffn_bench.py $shape --densities 0.0025,0.005,0.0075,0.01,0.015,0.02,0.05 --reps 10 \
          --no-variants --out "$OUT/ffn_bench.jsonl" 2>&1 | tee -a "$OUT/ffn_widths.log"
        status=$((status | ${PIPESTATUS[0]}))
      done
      ;;&
    transposeab)
      # The library's dense transpose (the default; TWELL_DENSE_TRANSPOSE=0 is torch's copy) against torch's copy,
      # which the torch adapter makes of W_down once a forward and three times a training step:
      # its tests, the three copies as stage rows, and the training step both ways.
      gpu_test_file tests/gpu/test_gpu_dense_transpose.py transposeab 240
      stage_rows "w_down transpose" "0.01" transposeab
      for t in 0 1; do
        TWELL_DENSE_TRANSPOSE=$t timeout 240 python3 bench/train_step.py --densities 0.005,0.01 --reps 10 \
          --out "$OUT/train_step.jsonl" 2>&1 | tail -4 | sed "s/^/transpose=$t: /" | tee -a "$OUT/transposeab.log"
        status=$((status | ${PIPESTATUS[0]}))
      done
      ;;&
    hostgap)
      # The eager host gaps of sparse calls at 2048 tokens (bench/NOTES.md, thirty-second session,
      # item 7): host time per call of the gated plan with the fixed spill and with the exact
      # read-back, then the FFN rows at 2048 tokens twice in one process each, to tell a gap that
      # follows the machine from one that follows the run.
      for flag in "" --exact; do
        timeout 120 python3 bench/host_profile.py --m 2048 --density 0.01 --calls 200 --top 20 $flag 2>&1 \
          | tail -30 | sed "s/^/host_profile${flag}: /" | tee -a "$OUT/hostgap.log"
        status=$((status | ${PIPESTATUS[0]}))
      done
      for i in 1 2; do
        timeout 100 python3 bench/ffn_bench.py --m 2048 --patterns uniform --densities 0.005,0.01 --reps 20 \
          --no-variants --out "$OUT/ffn_bench.jsonl" 2>&1 | tee -a "$OUT/hostgap.log" | tail -2
        status=$((status | ${PIPESTATUS[0]}))
      done
      ;;&
    producerncu)
      # Where the fused producer's pass 1 loses to cuBLASLt's GEMM at 16384 tokens (1.14x; not the
      # ring depth: thirty-second session, item 6): Nsight Compute on one launch of each.
      ncu_rows twell_gemm_pack "fused producer, pass 1" producerncu
      ncu_rows "gemm|sm90|cutlass" "gemm (cuBLASLt)" producerncu
      ;;&
    producerclocks)
      # The same two kernels with the clock free (ncu's --clock-control none; the thirty-third
      # session's fixed 1.42 GHz made pass 1 the faster, 612 against 627 us, while free-running
      # it is 1.14x slower): time, cycles and the SM clock each ran at, three launches each.
      for kernel in "twell_gemm_pack:fused producer" "gemm|sm90|cutlass|nvjet:gemm (cuBLASLt)"; do
        timeout 150 ncu --clock-control none --kernel-name regex:"${kernel%%:*}" --launch-skip 3 --launch-count 3 \
          --metrics gpu__time_duration.sum,sm__cycles_elapsed.max,sm__cycles_elapsed.avg.per_second,smsp__inst_executed.sum \
          python3 bench/stage_times.py --density 0.01 --reps 3 --only "${kernel#*:}" 2>&1 | tee -a "$OUT/producerclocks_ncu.log" \
          | grep -E "twell_gemm|nvjet|gemm|duration|cycles|inst_executed" | head -24 | sed "s/^/${kernel#*:}: /"
        status=$((status | ${PIPESTATUS[0]}))
      done
      ;;&
    producerenergy)
      # Energy per call and mean power (NVML's counter around two seconds of back-to-back calls)
      # of cuBLASLt's GEMM and pass 1 under each schedule, with and without the epilogue
      # (TWELL_HOPPER_PACK=0). Both run at the power cap, where time follows energy: the way to
      # compare producer builds (thirty-seventh and thirty-eighth sessions).
      for pack in "" 0; do
        TWELL_HOPPER_PACK=$pack timeout 120 python3 bench/producer_probe.py --energy 2>&1 | tail -9 \
          | sed "s/^/TWELL_HOPPER_PACK=${pack:-default}: /" | tee -a "$OUT/producerenergy.log"
        status=$((status | ${PIPESTATUS[0]}))
      done
      ;;&
    ffnenergy)
      # The gated and non-gated blocks under a sustained load (bench/ffn_energy.py: time and
      # energy per call, torch's dense blocks against the sparse plans, at the power cap).
      timeout 240 python3 bench/ffn_energy.py --out "$OUT/ffn_energy.jsonl" 2>&1 | tee -a "$OUT/ffnenergy.log"
      status=$((status | ${PIPESTATUS[0]}))
      ;;&
    wide)
      # d_model 4096 / d_ff 14336 after the stationary SpMM's column bands (thirty-ninth session,
      # item 6): the down projection's kernels at 4096-65536 rows, then the blocks around the new
      # crossings at 4096 and 16384 tokens, both patterns (bench/breakeven_fit.py reads
      # $OUT/ffn_bench.jsonl for _dispatch.CROSSINGS). ~5 minutes on an H200.
      timeout 150 python3 bench/down_choice.py --d-model 4096 --d-ff 14336 --m 4096,65536 \
        --densities 0.0025,0.005,0.01,0.02 --reps 5 --out "$OUT/down_choice.jsonl" 2>&1 | tee -a "$OUT/wide.log"
      status=$((status | ${PIPESTATUS[0]}))
      for m in 4096 16384; do
        timeout 240 python3 bench/ffn_bench.py --m $m --d-model 4096 --d-ff 14336 --patterns uniform,skewed \
          --densities 0.0075,0.01,0.015,0.02 --reps 5 --no-variants --out "$OUT/ffn_bench.jsonl" 2>&1 \
          | grep -E "^ *(uniform|skewed) " | tee -a "$OUT/wide.log"
        status=$((status | ${PIPESTATUS[0]}))
      done
      ;;&
    widestages)
      # The gated up projection (row gathers, the tiled kernel at 192-512 tokens a block and as
      # block_tokens sizes it) and the backward's dX (the dual form, banded) at d_model 4096 /
      # d_ff 14336, up to 2% (the token blocks past 1% are not measured; fortieth session).
      stage_rows "gated up,bwd dX" "0.005 0.01 0.015 0.02" wide --d-model 4096 --d-ff 14336 --reps 5
      ;;&
    sharedb)
      # The tiled up projection's shared-B form (x loaded once a quad; fortieth session) beside
      # the per-tile loads and the row gathers, at the standard widths: its GPU tests, then the
      # "gated up" stage rows at 0.5 / 1 / 2%.
      gpu_test_file tests/gpu/test_gpu_tiled_up.py sharedb 200
      stage_rows "gated up" "0.005 0.01 0.02" sharedb
      ;;&
    halfpack)
      # The tiled up pack's items on half-warps (forty-third session, branch tiled-up-half-warps):
      # the pack against the whole-warp form bit for bit and the tiled up tests, memcheck and
      # racecheck on the new test, then the pack's stage rows both ways at 16384 and 131072 tokens.
      gpu_test_file tests/gpu/test_gpu_tiled_up.py halfpack 240
      sanitize_tests tests/gpu/test_gpu_tiled_up.py "half_warps" halfpack
      width_rows TWELL_TILED_UP_PACK_WIDTH "tiled up pack" halfpack
      ;;&
    stationaryhalf)
      # The stationary pack on half-warps (forty-fifth session; opt-in TWELL_STATIONARY_PACK_WIDTH=16,
      # never run on a GPU before this step): both widths' words equal, the stationary tests with
      # the half-warps on, memcheck and racecheck on the new test, then the pack's stage rows (one
      # product and dX's dual form) both ways at 16384 and 131072 tokens.
      switch_tests tests/gpu/test_gpu_stationary.py stationaryhalf half_warps TWELL_STATIONARY_PACK_WIDTH=16 \
        "half_warps and (301 or 257)"
      width_rows TWELL_STATIONARY_PACK_WIDTH "stationary pack;stationary pack, dual" stationaryhalf
      ;;&
    pairs)
      # The tiled up projection in clusters of two sharing x's slices (forty-fourth session,
      # TWELL_TILED_UP_PAIRS): the same bits as the single blocks, the whole test file with the
      # pairs on, memcheck and racecheck on the new test's small shapes, then the forward's and
      # the backward's stage rows both ways at 16384 tokens and at the decoder batch, and the
      # decoder stack both ways.
      switch_tests tests/gpu/test_gpu_tiled_up.py pairs pairs TWELL_TILED_UP_PAIRS=1 \
        "pairs and (1-40 or 300-2000 or 1000-600)"
      stage_rows "tiled by density" "0.005 0.01" pairs  # single blocks and pairs side by side
      stage_rows "tiled by density" "0.005" pairs --m 131072 --reps 5
      for pairs in 1 0; do
        TWELL_TILED_UP_PAIRS=$pairs timeout 150 python3 bench/model_bench.py --densities 0.005 \
          --out "$OUT/model_bench.jsonl" 2>&1 | grep -E "density|captured" | sed "s/^/pairs=$pairs: /" | tee -a "$OUT/pairs.log"
      done
      ;;&
    tiledbwd)
      # The tiled up projection's backward form (the gated backward's sampled product,
      # forty-second session): its GPU tests and the callers' (the fused row gathers' own, the row
      # order's, the torch adapter's gradients), its stage rows beside the gathers' at 0.5-2% on
      # both widths, then the training step.
      gpu_test_file tests/gpu/test_gpu_tiled_up.py tiledbwd 240
      gpu_test_file tests/gpu/test_gpu_gather.py tiledbwd 120 -k fused_gated_backward
      gpu_test_file tests/gpu/test_gpu_row_order.py tiledbwd 120
      gpu_test_file tests/gpu/test_gpu_torch.py tiledbwd 240 -k "grad or training"
      stage_rows "bwd fused sddmm" "0.005 0.01 0.02" tiledbwd
      stage_rows "bwd fused sddmm" "0.005 0.01" tiledbwd --d-model 4096 --d-ff 14336 --reps 5
      # Blocks of more than 512 tokens (x's rows right after the part's units): the up
      # projection by block size at 16384 and 131072 tokens (the model's calls), 0.5 / 1%.
      stage_rows "gated up" "0.005 0.01" tiledbwd
      stage_rows "gated up, gather,gated up, tiled 512,gated up, tiled 640,gated up, tiled 768,gated up, tiled by" \
        "0.005 0.01" tiledbwd --m 131072 --reps 5
      timeout 200 python3 bench/train_step.py --out "$OUT/train_step.jsonl" 2>&1 | grep -v Warn | tee -a "$OUT/tiledbwd.log"
      status=$((status | ${PIPESTATUS[0]}))
      ;;&
    wide65536)
      # The same blocks at 65536 tokens (a call of its own: ~70 s per density and pattern).
      timeout 560 python3 bench/ffn_bench.py --m 65536 --d-model 4096 --d-ff 14336 --patterns uniform,skewed \
        --densities 0.0075,0.01,0.015 --reps 5 --no-variants --out "$OUT/ffn_bench.jsonl" 2>&1 \
        | grep -E "^ *(uniform|skewed) " | tee -a "$OUT/wide.log"
      status=$((status | ${PIPESTATUS[0]}))
      ;;&
    gatherblocks)
      # Row-gather blocks of 4, 1 (the default since the thirty-fifth session) and 2 rows
      # (TWELL_GATHER_BLOCK_WARPS; bench/NOTES.md, thirty-third session, item 9: a block's slots
      # stay held until its longest row ends): the gather tests with 4-row blocks, then
      # gather_layout_rows per setting.
      TWELL_GATHER_BLOCK_WARPS=4 gpu_test_file tests/gpu/test_gpu_gather.py gatherblocks 240
      for w in 4 1 2; do
        TWELL_GATHER_BLOCK_WARPS=$w gather_layout_rows gatherblocks
      done
      ;;&
    gatherblocksmodel)
      # The model's forward and train step at 0.5% under 4- and 1-row gather blocks alternately
      # (the model's 131072 rows a layer have the same imbalance; its up projection is ~2.1 of a
      # ~7.5 ms sparse MLP): the eager rows only, which is what the block size changes.
      for w in 4 1 4 1; do
        TWELL_GATHER_BLOCK_WARPS=$w timeout 90 python3 bench/model_bench.py --densities 0.005 --no-graphs \
          --reps 5 2>&1 | grep -i density | sed "s/^/rows per block $w: /" | tee -a "$OUT/gatherblocks.log"
        status=$((status | ${PIPESTATUS[0]}))
      done
      ;;&
    skewedtrain)
      # The training step on the skewed pattern (bench/NOTES.md, thirty-third session, item 10: a
      # hot unit's dW row is one warp's work in the transposed products), and the backward's
      # stages there at 0.5 / 1%; the uniform step beside it for the same run's ratio.
      for pattern in skewed uniform; do
        timeout 240 python3 bench/train_step.py --pattern "$pattern" --densities 0.005,0.01 --reps 10 \
          --out "$OUT/train_step.jsonl" 2>&1 | tail -4 | sed "s/^/$pattern: /" | tee -a "$OUT/skewedtrain.log"
        status=$((status | ${PIPESTATUS[0]}))
      done
      for d in 0.005 0.01; do
        timeout 200 python3 bench/stage_times.py --pattern skewed --density "$d" --only "bwd,gated up, gather" \
          --out "$OUT/stages.jsonl" 2>&1 | tee -a "$OUT/skewedtrain.log"
        status=$((status | ${PIPESTATUS[0]}))
      done
      ;;&
    segments)
      # The transposed products with their long rows cut into runs (TWELL_TRANSPOSED_SEGMENTS,
      # 2048 slots by default since the thirty-fifth session, the run length chosen so that the
      # runs fit): the cut's tests, the stages (cut, rows whole, columns whole, tiled) on both
      # patterns, then the training step with and without the cut on both (~4.5 minutes).
      gpu_test_file tests/gpu/test_gpu_segments.py segments 240
      for pattern in skewed uniform; do
        for d in 0.005 0.01 0.02; do
          timeout 200 python3 bench/stage_times.py --pattern "$pattern" --density "$d" \
            --only "bwd 3 transposed products" --out "$OUT/stages.jsonl" 2>&1 | tee -a "$OUT/segments.log"
          status=$((status | ${PIPESTATUS[0]}))
        done
      done
      for pattern in skewed uniform; do
        for slots in 0 2048; do
          TWELL_TRANSPOSED_SEGMENTS=$slots timeout 240 python3 bench/train_step.py --pattern $pattern \
            --densities 0.005,0.01 --reps 10 --out "$OUT/train_step.jsonl" 2>&1 | tail -4 \
            | sed "s/^/$pattern, slots $slots: /" | tee -a "$OUT/segments.log"
          status=$((status | ${PIPESTATUS[0]}))
        done
      done
      ;;&
    cuttrace)
      # Where the cut's uniform-pattern cost goes (thirty-sixth session: neither the runs' warps
      # first nor 4-warp blocks removed the 3-6%). The cut's tests first.
      gpu_test_file tests/gpu/test_gpu_segments.py cuttrace 120
      # The backward's products on one plan, one after another: the torch gradient and
      # captured-training tests.
      gpu_test_file tests/gpu/test_gpu_torch.py cuttrace 200 -k "grads or training_step"
      # Each kernel of the three transposed products, cut and rows whole, uniform and skewed at
      # 1% (bench/plan_trace.py --stages).
      for pattern in uniform skewed; do
        timeout 120 python3 bench/plan_trace.py --pattern $pattern --density 0.01 \
          --stages "bwd 3 transposed products;bwd 3 transposed products, rows whole" 2>&1 | tee -a "$OUT/cuttrace.log"
        status=$((status | ${PIPESTATUS[0]}))
      done
      # Then the cut's single product at 168 registers (TWELL_CUT_MAX_REGS; its default cap is 152
      # since the thirty-seventh session, 13 warps an SM as the plain kernel's, with 60 bytes of
      # spills): its tests, its trace, its times beside the default's.
      TWELL_CUT_MAX_REGS=168 gpu_test_file tests/gpu/test_gpu_segments.py cuttrace 120
      TWELL_CUT_MAX_REGS=168 timeout 120 python3 bench/plan_trace.py --pattern uniform --density 0.01 \
        --stages "bwd 3 transposed products" 2>&1 | sed "s/^/168 regs: /" | tee -a "$OUT/cuttrace.log"
      status=$((status | ${PIPESTATUS[0]}))
      for case in "uniform 0.005" "uniform 0.01" "skewed 0.01"; do
        set -- $case
        for regs in "" 168; do
          TWELL_CUT_MAX_REGS=$regs timeout 100 python3 bench/stage_times.py --pattern "$1" --density "$2" \
            --only "bwd 3 transposed products" --out "$OUT/stages.jsonl" 2>&1 | grep -v "columns whole\|tiled" \
            | sed "s/^/max regs ${regs:-152}, $1 $2: /" | tee -a "$OUT/cuttrace.log"
          status=$((status | ${PIPESTATUS[0]}))
        done
      done
      ;;&
    roworder)
      # The rows longest first (TWELL_GATHER_ROW_ORDER, a build switch) with blocks of 4 and 1 rows
      # (1 is the default; bench/NOTES.md, thirty-third session, item 9): the order's tests and
      # the gather tests in that build, then gather_layout_rows; the index-order rows to compare
      # with are gatherblocks', so run both in one call (`device_run.sh gatherblocks roworder`).
      TWELL_GATHER_ROW_ORDER=1 gpu_test_file tests/gpu/test_gpu_row_order.py roworder 240
      TWELL_GATHER_ROW_ORDER=1 gpu_test_file tests/gpu/test_gpu_gather.py roworder 240
      for w in 4 1; do
        TWELL_GATHER_BLOCK_WARPS=$w TWELL_GATHER_ROW_ORDER=1 gather_layout_rows roworder
      done
      ;;&
    smallm)
      # Few tokens per call (decoding): the sparse blocks against dense and what `auto` takes, at
      # 1-2048 tokens of the standard widths (both blocks; the crossings under 4096 tokens).
      for m in 1 8 64 256 1024 2048; do
        python3 bench/ffn_bench.py --m "$m" --patterns uniform --densities 0.0025,0.005,0.01,0.02 --reps 20 \
          --no-variants --out "$OUT/ffn_bench.jsonl" 2>&1 | tee -a "$OUT/smallm.log"
        status=$((status | ${PIPESTATUS[0]}))
      done
      ;;&
    jax|all)
      XLA_PYTHON_CLIENT_PREALLOCATE=false python3 bench/jax_bench.py --out "$OUT/jax_bench.jsonl" 2>&1 | tee "$OUT/jax_bench.log"
      status=$((status | ${PIPESTATUS[0]}))
      ;;&
    micro|all)
      python3 -m twellsparse bench --out "$OUT/micro" 2>&1 | tee "$OUT/micro.log" | tail -60
      status=$((status | ${PIPESTATUS[0]}))
      ;;&
    trainprofile)
      python3 bench/train_step.py --densities 0.01 --reps 5 --profile 2>&1 | tee "$OUT/train_profile.log" | tail -60
      ;;&
    stages)
      # Every stage, or those TWELL_STAGES names (stage_times.py --only).
      stage_rows "${TWELL_STAGES:-}" "0.005 0.01" stages
      ;;&
    hints)
      # The gather kernels' L2 eviction hint off and on (TWELL_L2_HINTS 0 / 1,
      # cuda/twell_gather.cu) side by side: stage times at 0.5% and 1% for each build.
      for h in 0 1; do
        for d in 0.005 0.01; do
          TWELL_L2_HINTS=$h python3 bench/stage_times.py --density $d --out "$OUT/hints.jsonl" 2>&1 \
            | sed "s/^/hints=$h d=$d  /" | tee -a "$OUT/hints.log" | grep -E "consumer|spmm|sddmm|products|dX|plan gated"
          status=$((status | ${PIPESTATUS[0]}))
        done
      done
      ;;&
    fp8)
      # The fp8 e4m3 weight rows (opt-in): their GPU tests, then the down SpMM's stage times with
      # bf16 rows and with e4m3 rows side by side, 0.5% and 1%.
      timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_quantize.py 2>&1 \
        | tee -a "$OUT/fp8.log" | tail -3
      status=$((status | ${PIPESTATUS[0]}))
      for d in 0.005 0.01; do
        python3 bench/stage_times.py --density $d --only "down spmm" --out "$OUT/stages.jsonl" 2>&1 \
          | sed "s/^/d=$d  /" | tee -a "$OUT/fp8.log" | grep -E "spmm"
      done
      ;;&
    minblocks)
      # The launch bounds of the 2-byte SpMM and transposed-product kernels: the gather tests on
      # the default build (a minimum of 1 block per SM for the single-output kernels, none for
      # dX's dual pass), then stage times side by side with the build that names no minimum
      # (TWELL_GATHER_MIN_BLOCKS=0), 0.5% and 1%.
      timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_gather.py \
        -k "spmm or transposed" 2>&1 | tee -a "$OUT/minblocks.log" | tail -3
      status=$((status | ${PIPESTATUS[0]}))
      for b in default 0; do
        for d in 0.005 0.01; do
          env $([ $b = default ] || echo TWELL_GATHER_MIN_BLOCKS=$b) python3 bench/stage_times.py --density $d \
            --only "spmm,transposed products,dX,plan" --out "$OUT/minblocks.jsonl" 2>&1 | sed "s/^/blocks=$b d=$d  /" \
            | tee -a "$OUT/minblocks.log" | grep -E "spmm|products|dX|plan"
        done
      done
      ;;&
    benchquick)
      python3 bench/ffn_bench.py --quick --densities 0.01 --patterns uniform 2>&1 | tee "$OUT/ffn_bench_quick.log"
      status=$((status | ${PIPESTATUS[0]}))
      ;;&
    profile)
      # Each kernel's duration in one gated plan call (1%, uniform): where the producer's time goes.
      python3 bench/ffn_bench.py --densities 0.01 --patterns uniform --profile >/dev/null 2>&1  # warm the cache
      ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum \
        python3 bench/ffn_bench.py --densities 0.01 --patterns uniform --profile 2>&1 | tee "$OUT/ncu.log" \
        | grep -E "^  [a-zA-Z_].*\(|gpu__time_duration" | paste - - | awk '{print $NF, $1}' | tail -40
      ;;&
    hostprofile)
      # The plan call's host time, then the eager torch training step's (exact spill, then a
      # fixed spill_capacity): where the eager step's time beyond the captured one goes.
      python3 bench/host_profile.py 2>&1 | tee "$OUT/host_profile.log" | head -80
      for mode in "" "--fixed"; do
        timeout 240 python3 bench/host_profile.py --torch-step $mode --calls 30 2>&1 | tee -a "$OUT/host_profile.log" | head -60
      done
      ;;&
    hostphases)
      # The eager torch step's parts timed without a profiler: forward, backward, conversions.
      timeout 240 python3 bench/host_profile.py --torch-phases --calls 50 2>&1 | grep -v Warning \
        | tee -a "$OUT/host_phases.log"
      timeout 120 python3 bench/host_profile.py --sync-probe 2>&1 | grep -v Warning | tee -a "$OUT/host_phases.log"
      ;;&
    probe)
      # Nsight Compute on one SpMM call (1%, TWELL_PROBE_PATH: gather or portable): throughput sections, then the SASS lines
      # with the most warp-stall samples (the source page as CSV, parsed on the host).
      ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section LaunchStats \
        python3 bench/kernel_probe.py --path ${TWELL_PROBE_PATH:-gather} 2>&1 | tee "$OUT/probe.log" | tail -120
      ncu --profile-from-start off --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
        python3 bench/kernel_probe.py --path ${TWELL_PROBE_PATH:-gather} > "$OUT/probe_source.csv" 2>&1
      ;;&
    stationary)
      # The weight-stationary SpMM (cuda/twell_stationary.cu): its tests, the down projection's
      # stage times (with its pack, and the pack alone), the FFN benchmark (the kernel alone
      # beside the row gathers, and the plan taking it), memcheck and racecheck.
      gpu_test_file tests/gpu/test_gpu_stationary.py stationary
      stage_rows "down spmm,stationary" "0.005 0.01" stationary
      timeout 300 python3 bench/ffn_bench.py --densities 0.005,0.01,0.02 --patterns uniform --out "$OUT/ffn_bench.jsonl" 2>&1 \
        | tee -a "$OUT/stationary.log"
      # memcheck and racecheck on the stationary kernels alone (the smoke's calls of them).
      for tool in memcheck racecheck; do
        timeout 120 compute-sanitizer --tool $tool --kernel-name kns=stationary --error-exitcode 3 \
          python3 scripts/sanitize_smoke.py 2>&1 | tail -4 | sed "s/^/$tool  /" | tee -a "$OUT/stationary.log"
        status=$((status | ${PIPESTATUS[0]}))
      done
      ;;&
    tiled)
      # The tiled up projection (cuda/twell_tiled_up.cu): its tests, the up projection's stage
      # times by each kernel (and the tiled one per block size, its pack alone), Nsight Compute
      # on one launch (throughput, shared-memory wavefronts per request, warp states).
      gpu_test_file tests/gpu/test_gpu_tiled_up.py tiled
      stage_rows "gated up,tiled up pack" "0.005 0.01 0.02" tiled
      timeout 120 ncu --kernel-name regex:twell_tiled_gated_up --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section SchedulerStats --section WarpStateStats \
        --metrics smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio \
        python3 bench/stage_times.py --density 0.01 --reps 3 --only "gated up, tiled 512" 2>&1 | tail -120 \
        | tee -a "$OUT/tiled_ncu.log" | grep -E "Duration|Throughput|Issued|stalled|wavefronts|conflicts|inst_executed|Eligible" | head -50
      ;;&
    tiledspmm)
      # The tensor-core SpMM (cuda/twell_tiled_spmm.cu, opt-in): its tests (a hang ends at the
      # timeout), the down projection, dX and the transposed products by each kernel with their
      # packs, the tiled packs and product alone, Nsight Compute on one product.
      gpu_test_file tests/gpu/test_gpu_tiled_spmm.py tiledspmm 300
      stage_rows "down spmm,stationary pack,tiled spmm pack,bwd dX,transposed" "0.005 0.01 0.02" tiledspmm
      ncu_rows twell_tiled_spmm "down spmm, tiled, packed" tiledspmm
      timeout 150 python3 bench/down_choice.py --m 4096,16384,65536 --densities 0.0025,0.005,0.01,0.02 \
        --out "$OUT/down_choice.jsonl" 2>&1 | tee -a "$OUT/tiledspmm.log"
      ;;&
    tiledquick)
      # The tiled SpMM's tests, the suite's SpMM and torch tests with the tiled kernels forced on,
      # its stage rows and Nsight Compute (with the stall reasons) on one product.
      gpu_test_file tests/gpu/test_gpu_tiled_spmm.py tiledquick 300
      for f in test_gpu_ops test_gpu_torch; do
        TWELL_TILED_SPMM=1 TWELL_TILED_FFN=1 gpu_test_file tests/gpu/$f.py tiledquick 240
      done
      stage_rows "down spmm,stationary pack,tiled spmm pack,tiled spmm fragments,one pack" "0.005 0.01 0.02" tiledquick
      ncu_rows twell_tiled_spmm "down spmm, tiled, packed" tiledquick
      ;;&
    tiledwarps)
      # The tiled SpMM with 32 warps of 2 row groups (TWELL_TILED_WARPS=32) beside the default 16
      # of 4, each with the one-hot operand loaded (fragments), shuffled from the words
      # (TWELL_TILED_OPERAND=shuffles), or shuffled from words prefetched into L1 a chunk ahead
      # (prefetched): its tests, the tiled product rows (down, the backward's) all six ways,
      # Nsight Compute on the prefetched one.
      # The rows first (~30 s a variant), so that a call cut short keeps the measurement; the
      # tests (which compare every variant bit for bit) after them.
      for w in 16 32; do
        for operand in fragments shuffles prefetched; do
          TWELL_TILED_WARPS=$w TWELL_TILED_OPERAND=$operand stage_rows \
            "down spmm, tiled,bwd 3 transposed products, tiled,bwd dX, tiled" "0.005 0.01 0.02" tiledwarps
        done
      done
      TWELL_TILED_WARPS=32 gpu_test_file tests/gpu/test_gpu_tiled_spmm.py tiledwarps 300
      TWELL_TILED_OPERAND=prefetched ncu_rows twell_tiled_spmm "down spmm, tiled, packed" tiledwarps
      ;;&
    multigpu|multigputests)
      # Issue 7 on a machine with two GPUs (nvidia-h200-x2), in two calls (each fits the device
      # tool's 10 minutes): `multigputests`, the 2-GPU tests (DDP and FSDP2 over NCCL against one
      # GPU, JAX over two GPUs); then `multigpu`, training throughput per GPU against dense
      # (gated MLP stacks of the standard widths, bf16, gates thresholded to 0.5% and 1%): one GPU
      # with 16384 tokens (the scaling baseline), torch DDP and FSDP2 over two with 16384 tokens a
      # rank, JAX's shard_map step on one GPU and on two. Records in $OUT/distributed.jsonl; every
      # run's whole output in $OUT/multigpu.log, its exit status joins the run's.
      if [ "$step" = multigputests ]; then
        gpu_test_file tests/gpu/test_gpu_distributed.py multigpu 540
      else
        # --l1 0: the TwELL and dense models do the same work (the penalty is the TwELL model's
        # only); 12 steps: the median of 11 after the first. XLA must not preallocate (CuPy's
        # kernels allocate beside it, twellsparse/jax.py).
        export XLA_PYTHON_CLIENT_PREALLOCATE=false
        # TWELL_DENSITIES="0.005" (then "0.01") splits it over two calls where one runs too long.
        shape="--dtype bfloat16 --d-model 2048 --d-ff 5632 --steps 12"
        for density in ${TWELL_DENSITIES:-0.005 0.01}; do
          for mlp in "" --dense; do
            timeout 100 python3 examples/distributed_train.py --single $shape --l1 0 --layers 4 --tokens 16384 \
              --density $density $mlp --json "$OUT/distributed.jsonl" 2>&1 | tee -a "$OUT/multigpu.log" | tail -2
            status=$((status | ${PIPESTATUS[0]}))
            for mode in "" --fsdp; do
              timeout 100 python3 -m torch.distributed.run --standalone --nproc_per_node=2 examples/distributed_train.py \
                $mode $shape --l1 0 --layers 4 --tokens 32768 --density $density $mlp --json "$OUT/distributed.jsonl" 2>&1 \
                | tee -a "$OUT/multigpu.log" | tail -2
              status=$((status | ${PIPESTATUS[0]}))
            done
            for devices in "--devices 1 --tokens 16384" "--tokens 32768"; do
              timeout 100 python3 examples/jax_data_parallel.py $shape $devices --density $density $mlp \
                --json "$OUT/distributed.jsonl" 2>&1 | tee -a "$OUT/multigpu.log" | tail -2
              status=$((status | ${PIPESTATUS[0]}))
            done
          done
        done
      fi
      ;;&
    tiledffn)
      # The gated consumer on one pack (cuda/twell_tiled_ffn.cu, opt-in): its tests, its stage
      # rows beside the current consumer and backward, the FFN benchmark with both tiled switches
      # on (recorded as settings), Nsight Compute on the up kernel.
      gpu_test_file tests/gpu/test_gpu_tiled_ffn.py tiledffn 300
      stage_rows "gated consumer,one pack,gated up, gather,bwd sddmm,bwd dX" "0.005 0.01 0.02" tiledffn
      TWELL_TILED_FFN=1 TWELL_TILED_SPMM=1 timeout 300 python3 bench/ffn_bench.py --densities 0.005,0.01,0.02 \
        --patterns uniform,skewed --out "$OUT/ffn_bench.jsonl" 2>&1 | tee -a "$OUT/tiledffn.log"
      ncu_rows twell_tiled_ffn_up "gated up, one pack, packed" tiledffn
      ;;&
    decoderncu)
      # Where the decoder batch's up and down projections wait (forty-fourth session): Nsight
      # Compute on the tiled up projection and the stationary SpMM at 131072 tokens, 0.5% (the
      # model's calls; is the up projection's TMA staging, W_up per token block and x per unit
      # part, bound by L2 bandwidth there?).
      ncu_rows twell_stationary_spmm "down spmm, stationary" decoderncu --m 131072 --density 0.005
      ;;&
    decoderncu|upncu)
      # Nsight Compute's stall and memory sections on the tiled up projection as the decoder
      # batch's plan runs it.
      ncu_rows twell_tiled_gated_up "gated up, tiled by density" "$step" --m 131072 --density 0.005
      ;;&
    decoderncu|decodermemory)
      # Latency or delivery (bench/NOTES.md, forty-fourth session, item 6): the memory chart and
      # tables (bytes between L2 and the SMs, L2 reads) of the single blocks and of the pairs,
      # whose multicast halves x's L2 reads but not the bytes each SM receives.
      # The metrics: sectors the L2 served to the SMs' L1/TEX units and bytes over the crossbar
      # into them, the TMA's (shared-memory) share, and the kernel's time and clock.
      memory="--section MemoryWorkloadAnalysis_Chart --section MemoryWorkloadAnalysis_Tables --metrics \
lts__t_sectors_srcunit_tex_op_read.sum,l1tex__m_xbar2l1tex_read_bytes.sum,l1tex__m_xbar2l1tex_read_bytes.sum.per_second,\
smsp__sass_inst_executed_op_shared_ld.sum,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second"
      NCU_SECTIONS=$memory ncu_rows twell_tiled_gated_up "gated up, tiled by density" decoderncu_memory \
        --m 131072 --density 0.005
      NCU_SECTIONS=$memory ncu_rows twell_tiled_gated_up "gated up, tiled by density, pairs" decoderncu_memory \
        --m 131072 --density 0.005
      ;;&
    tokenstep)
      # Token blocks in steps of 16 instead of 64 (the block count's waves: at 131072 tokens,
      # 0.5%, 800 tokens run 10 waves of 8 parts where 768 run 11): the block sizes each step picks
      # at 16384 (0.5 / 1 / 2%: 512 / 336 or 384 / 208 or 512) and at 131072 tokens (800 or 768).
      stage_rows "tiled 208,tiled 336,tiled 384,tiled 512,tiled by density" "0.005 0.01 0.02" tokenstep
      stage_rows "tiled 768,tiled 800,tiled by density" "0.005" tokenstep --m 131072
      ;;&
    upab)
      up_ab_rows upab
      ;;&
    ordereda)
      # The default, then without the 4 register moves a tile spends ordering its A fragment
      # (TWELL_TILED_UP_ORDERED_A=1: wrong sums, the time a W_up stored in the fragment's order
      # would take).
      up_ab_rows ordereda
      TWELL_TILED_UP_ORDERED_A=1 up_ab_rows ordereda
      ;;&
    tmaprobe)
      # The copy engine's rate into one SM by the shape of its copies (rows of 64, 128 or 256
      # bytes, slices laid out contiguously, bulk chunks) and bytes in flight: is the tiled up
      # projection's staging at ~36 GB/s per SM its 64-byte rows' limit?
      timeout 120 python3 bench/tma_probe.py --out "$OUT/tma_probe.jsonl" 2>&1 | tee -a "$OUT/tmaprobe.log"
      ;;&
    tiledcheck)
      # compute-sanitizer memcheck and racecheck on the tiled kernels' small test cases.
      sanitize_tests tests/gpu/test_gpu_tiled_spmm.py "40-16 or strided or graph or 300-2000" tiledcheck  # both warp counts
      sanitize_tests tests/gpu/test_gpu_tiled_ffn.py "40-16 or 40-32 or switched" tiledcheck
      # The up projection, the default beyond the L2 since the fortieth session: the plan with
      # token blocks from its estimate (spill included), u not kept, a strided x; its backward
      # form (forty-second session) on the heavy-spill shape and the 936-token blocks.
      sanitize_tests tests/gpu/test_gpu_tiled_up.py \
        "auto_plan or without_u or (tiled_backward and (300-2000 or 1000-600))" tiledcheck
      ;;&
    tiledmodel)
      # The decoder stack (issue 5's whole-model benchmark) with the tiled kernels forced on, eager
      # (the settings are recorded in each line; the default run is `training`).
      TWELL_TILED_SPMM=1 TWELL_TILED_FFN=1 timeout 540 python3 bench/model_bench.py --densities 0.005,0.01 --no-graphs \
        --out "$OUT/model_bench.jsonl" 2>&1 | tee -a "$OUT/tiledmodel.log" | tail -20
      status=$((status | ${PIPESTATUS[0]}))
      ;;&
    tiledforced)
      # The suite's SpMM, FFN and torch tests and the training step with the tiled kernels forced
      # on where they apply.
      for f in test_gpu_ops test_gpu_torch test_gpu_fixed_spill test_gpu_jax; do
        TWELL_TILED_SPMM=1 TWELL_TILED_FFN=1 gpu_test_file tests/gpu/$f.py tiledforced 240
      done
      for switches in "TWELL_TILED_SPMM=1" "TWELL_TILED_SPMM=1 TWELL_TILED_FFN=1"; do
        env $switches timeout 200 python3 bench/train_step.py --out "$OUT/train_step.jsonl" 2>&1 \
          | tee -a "$OUT/tiledforced.log" | tail -4
      done
      ;;&
    dual)
      # The stationary SpMM's dual form (dX = dZ W_gate + dU W_up in one pass, opt-in): its
      # tests, the backward's dX by the row gathers and by it, and the training step with the
      # stationary kernels forced on (TWELL_STATIONARY=1, recorded as a setting) after the default.
      gpu_test_file tests/gpu/test_gpu_stationary.py dual
      stage_rows dX "0.005 0.01" dual
      timeout 200 python3 bench/train_step.py --out "$OUT/train_step.jsonl" 2>&1 | tee -a "$OUT/dual.log" | tail -4
      TWELL_STATIONARY=1 timeout 200 python3 bench/train_step.py --out "$OUT/train_step.jsonl" 2>&1 \
        | tee -a "$OUT/dual.log" | tail -4
      ;;&
    downchoice)
      # The down projection's two kernels (row gathers, stationary with its pack) over token
      # counts and densities: the data behind _stationary.MIN_ROWS.
      timeout 240 python3 bench/down_choice.py --out "$OUT/down_choice.jsonl" 2>&1 | tee -a "$OUT/downchoice.log"
      status=$((status | ${PIPESTATUS[0]}))
      timeout 120 python3 bench/down_choice.py --m 16384,65536 --d-model 4096 --out "$OUT/down_choice.jsonl" 2>&1 \
        | tee -a "$OUT/downchoice.log"
      ;;&
    transposedprobe)
      # The backward's paired transposed product (it gathers token rows of x, 64 MB at 16384
      # tokens, more than the L2) beside the down SpMM (weight rows, 23 MB): L2 hit rate, DRAM
      # bytes, duration and warp states, at 0.5% and 1%; first the transposed products' tests
      # and their stage times with and without the column split.
      python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_gpu_gather.py -k transposed 2>&1 | tail -3 \
        | tee -a "$OUT/transposed_probe.log"
      status=$((status | ${PIPESTATUS[0]}))
      for d in 0.005 0.01; do
        python3 bench/stage_times.py --density $d --only "transposed" --out "$OUT/stages.jsonl" 2>&1 \
          | tee -a "$OUT/transposed_probe.log" | grep -E "transposed"
      done
      for d in 0.005 0.01; do
        for k in transposed spmm; do
          ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats --section Occupancy \
            --metrics lts__t_sector_hit_rate.pct,dram__bytes_read.sum,smsp__inst_executed.sum \
            python3 bench/kernel_probe.py --kernel $k --density $d 2>&1 | tee -a "$OUT/transposed_probe.log" \
            | grep -E "twell_|Duration|hit_rate|dram__bytes|inst_executed|Achieved Active|Memory Throughput"
        done
      done
      ;;&
    producerab)
      # A producer candidate checked, then measured in one go: the Hopper tests under a timeout (a
      # barrier bug hangs), the probe, the GEMM without its epilogue, each in its own process, and
      # the clocks last (the nvidia-smi sampling slows the timings of its own run by 0.03-0.05 ms).
      gpu_test_file tests/gpu/test_gpu_hopper.py hopper_tests 300
      timeout 60 python3 bench/producer_probe.py 2>&1 | tail -3 | tee -a "$OUT/producer_ab.log"
      TWELL_HOPPER_PACK=0 timeout 60 python3 bench/producer_probe.py 2>&1 | tail -3 | tee -a "$OUT/producer_ab.log"
      timeout 90 python3 bench/producer_probe.py --clocks 2>&1 | tail -7 | tee -a "$OUT/producer_ab.log"
      ;;&
    modelschedule)
      # The model's layers under the pair and inline schedules alternately, and the producer
      # alone at the model's 131072 tokens per layer, plain and thresholded (the twentieth
      # session's 7% forward regression was the thresholded epilogue under the pair schedule).
      for schedule in pair inline pair inline; do
        TWELL_HOPPER_SCHEDULE=$schedule timeout 90 python3 bench/model_bench.py --densities 0.005 --no-graphs \
          --reps 5 2>&1 | grep -i density | sed "s/^/$schedule: /" | tee -a "$OUT/model_schedule.log"
      done
      for thr in "" "--threshold 0"; do  # plain relu, and the thresholded keep path the model takes
        timeout 120 python3 bench/producer_probe.py --m 131072 $thr 2>&1 | tail -3 | tee -a "$OUT/model_schedule.log"
      done
      ;;&
    producerprobe)
      # Where the fused producer's pass 1 spends its time beyond the GEMM: the probe with and
      # without the epilogue (TWELL_HOPPER_PACK=0), then Nsight Compute on one twell_gemm_pack
      # launch (throughput, warp states, instruction mix) and its SASS with stall samples (CSV,
      # parsed on the host).
      timeout 90 python3 bench/producer_probe.py --clocks 2>&1 | tail -7 | tee -a "$OUT/producer_probe.log"
      TWELL_HOPPER_PACK=0 timeout 60 python3 bench/producer_probe.py 2>&1 | tail -3 | tee -a "$OUT/producer_probe.log"
      ncu --kernel-name regex:twell_gemm_pack --launch-skip 2 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section InstructionStats --section SchedulerStats --section Occupancy \
        python3 bench/producer_probe.py 2>&1 | tail -150 | tee -a "$OUT/producer_probe.log" | grep -E "Duration|Throughput|Issued|Stall|Eligible" | head -30
      ncu --kernel-name regex:twell_gemm_pack --launch-skip 2 --launch-count 1 --section SourceCounters \
        --section WarpStateStats --page source --print-source sass --csv python3 bench/producer_probe.py \
        > "$OUT/producer_source.csv" 2>&1
      ;;&
    sanitize|all)
      bash scripts/sanitize.sh 2>&1 | tee "$OUT/sanitize.log" | tail -30
      status=$((status | ${PIPESTATUS[0]}))
      ;;
  esac
done
exit $status
