#!/usr/bin/env bash
# One call on a GPU machine: build (unless BUILD_DIR already holds a CUDA
# build), run the GPU tests, run them under compute-sanitizer (memcheck,
# racecheck, synccheck, initcheck; in shards, SHARDS / SHARD_COUNT below),
# benchmark, and print a short table last. Full logs go to $OUT.
#   STAGES="tests sanitize steps bench kernel dsa" (the default; also: soak multitoken peers dispatch sweep sass
#   profile ab pytest; ab: the same-run A/B against another commit's programs; pytest: tests/python on the
#   built extension; see their stages below)
set -uo pipefail
cd "$(dirname "$0")/.."
# Logs are written to LOGS and packed into one archive in $OUT at the end: gpu-logs.tar.gz, or
# gpu-logs-<name of LOGS>.tar.gz when LOGS is set, so that calls run side by side (e.g. the GPU
# suite beside the pytest stage) keep their own (a device call returns only a few files).
RESULTS=${OUT:-/tmp/sparsepage-gpu}
OUT=${LOGS:-/tmp/sparsepage-gpu-logs}
mkdir -p "$OUT" "$RESULTS"
BUILD=${BUILD_DIR:-build-cuda}
STAGES=${STAGES:-"tests sanitize steps bench kernel dsa"}  # also: soak multitoken peers dispatch sweep sass profile ab pytest
summary=()
note() { summary+=("$1"); echo "== $1"; }

# A build shipped from the development machine (scripts/ship.sh) comes compressed.
find "$BUILD" -name '*.xz' -exec xz -d -f {} + 2>/dev/null
if [ ! -x "$BUILD/tests/cuda/sparsepage_cuda_tests" ]; then
  gtest=/usr/src/googletest; [ -d .deps/googletest ] && gtest=$PWD/.deps/googletest
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSPARSEPAGE_CUDA=ON \
    -DSPARSEPAGE_GTEST_SOURCE="$gtest" > "$OUT/build.log" 2>&1 && cmake --build "$BUILD" -j "$(nproc)" >> "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; echo "build failed"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
T="$BUILD/tests/cuda/sparsepage_cuda_tests"
B="$BUILD/tools/sparse_paged_decode_bench"
S="$BUILD/tools/sparse_step_bench"
failed=0

if [[ $STAGES == *tests* ]]; then
  # The indexer timing tests run too (they skip without this switch).
  SPARSEPAGE_INDEXER_TIMING=1 "$T" > "$OUT/cuda_tests.log" 2>&1; rc=$?
  note "GPU tests: rc=$rc, $(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$OUT/cuda_tests.log" | tr '\n' ' ')"
  [ $rc -eq 0 ] || { failed=1; grep -E "Failure|FAILED|error" -A4 "$OUT/cuda_tests.log" | head -60; }
  # On a machine with a GPU every GPU test must run: a skip here means the
  # driver or the build is broken, not that the test does not apply.
  if grep -qE '^\[  SKIPPED' "$OUT/cuda_tests.log"; then
    failed=1; note "GPU tests SKIPPED on a GPU machine: $(grep -cE '^\[  SKIPPED \]' "$OUT/cuda_tests.log") (a failure here)"
  fi
  "$BUILD/tests/sparsepage_cpu_tests" > "$OUT/cpu_tests.log" 2>&1
  note "CPU tests on the GPU machine: rc=$?, $(grep -E '^\[  PASSED' "$OUT/cpu_tests.log")"
fi
if [[ $STAGES == *sanitize* ]]; then
  # The GPU suite under compute-sanitizer's memcheck, racecheck, synccheck
  # and initcheck, in SHARD_COUNT shards (gtest's own: test i of the run
  # order goes to shard i % SHARD_COUNT), with the tests that are slow only
  # for their size at their quick size (SPARSEPAGE_TEST_QUICK=1,
  # tests/cuda/cuda_test_util.h). SANITIZE_JOBS (tool, shard) pairs run at
  # once on the one GPU (default 15), SHARDS picks shards and SANITIZE_TOOLS
  # the tools (default: all; a whole pass takes more than one ten-minute
  # call). Each pair has SANITIZE_TIMEOUT seconds (default 400) and prints
  # one line: rc, seconds, tests passed / failed, and the tool's summary;
  # "TIMEOUT" when it ran out (then raise SHARD_COUNT). The >2^31-element
  # pool test moves gigabytes and the soak has its own stage: they stay out.
  # A pass may span calls: SANITIZE_DIR (default: the logs folder) keeps
  # each pair's log and result, a pair already clean there is not run
  # again, and SANITIZE_BUDGET seconds (default: none) bound this call: no
  # pair starts after it and each pair's timeout ends with it ("not run" /
  # TIMEOUT pairs are run by the next call with the same SANITIZE_DIR).
  shard_count=${SHARD_COUNT:-64}
  shards=${SHARDS:-$(seq -s ' ' 0 $((shard_count - 1)))}
  san_dir=${SANITIZE_DIR:-$OUT}
  mkdir -p "$san_dir"
  deadline=$(( $(date +%s) + ${SANITIZE_BUDGET:-1000000} ))
  sanitize_one() {  # tool shard -> log, and one result line in log.result
    local tool=$1 shard=$2 log="$san_dir/sanitizer_$1_shard$2of${shard_count}.log" start rc limit
    if [ -f "$log.result" ] && [ "$(cut -d' ' -f1 "$log.result")" = 0 ]; then return; fi
    start=$(date +%s)
    limit=$(( deadline - start )); [ "$limit" -gt "${SANITIZE_TIMEOUT:-400}" ] && limit=${SANITIZE_TIMEOUT:-400}
    [ "$limit" -lt 15 ] && return
    GTEST_TOTAL_SHARDS=$shard_count GTEST_SHARD_INDEX=$shard SPARSEPAGE_TEST_QUICK=1 \
      timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 9 "$T" \
      --gtest_filter="${SANITIZE_FILTER:--*Beyond2To31*:*.Soak}" > "$log" 2>&1
    rc=$?
    local secs=$(( $(date +%s) - start )) state=""
    [ $rc -eq 124 ] && state=" TIMEOUT"
    echo "$rc sanitize $tool shard $shard/$shard_count:$state rc=$rc, ${secs}s," \
      "$(grep -cE '^\[       OK \]' "$log") passed," \
      "$(grep -cE '^\[  FAILED  \] [A-Za-z].* \([0-9]+ ms\)$' "$log") failed," \
      "$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1 | sed 's/^=* *//')" > "$log.result"
  }
  # The slowest tool first (racecheck, then memcheck), so that the long
  # pairs start while every slot is free and none is left for the tail.
  pairs=()
  for tool in ${SANITIZE_TOOLS:-racecheck memcheck initcheck synccheck}; do
    for shard in $shards; do pairs+=("$tool $shard"); done
  done
  running=0
  for pair in "${pairs[@]}"; do
    # shellcheck disable=SC2086
    sanitize_one $pair &
    running=$((running + 1))
    if [ $running -ge "${SANITIZE_JOBS:-15}" ]; then wait -n; running=$((running - 1)); fi
  done
  wait
  clean=0 dirty=0 notrun=0
  for pair in "${pairs[@]}"; do
    set -- $pair
    log="$san_dir/sanitizer_$1_shard$2of${shard_count}.log"
    if ! read -r rc line < "$log.result" 2>/dev/null; then
      notrun=$((notrun + 1)); failed=1; note "sanitize $1 shard $2/$shard_count: not run (budget)"; continue
    fi
    note "$line"
    if [ "$rc" -ne 0 ]; then
      dirty=$((dirty + 1)); failed=1
      grep -E "^========= (Invalid|Race|Barrier|Uninitialized|Error)|Failure|FAILED" -A3 "$log" | head -20
    else
      clean=$((clean + 1))
    fi
  done
  # One line over every pair: what a reader checks first.
  note "sanitizers: ${#pairs[@]} (tool, shard) pairs: $clean clean, $dirty not clean, $notrun not run"
  [ "$san_dir" != "$OUT" ] && cp "$san_dir"/sanitizer_*.log* "$OUT"/ 2>/dev/null
fi
if [[ $STAGES == *soak* ]]; then
  # Continuous batching for minutes: a ragged batch with requests joining
  # and leaving and refused calls mixed in, every live request checked
  # against its lone run. SOAK_SECONDS set: the three layers share that
  # many seconds (570 fits one ten-minute device call; the timeout allows
  # for the build check and the last step); else each layer SOAK_STEPS
  # steps (default 20000).
  if [ -n "${SOAK_SECONDS:-}" ]; then
    soak_what="${SOAK_SECONDS} s over three layers"
    SPARSEPAGE_SOAK_SECONDS=$SOAK_SECONDS timeout ${SOAK_TIMEOUT:-$((SOAK_SECONDS + 25))} "$T" \
      --gtest_filter='ContinuousBatchingCuda.Soak' > "$OUT/soak.log" 2>&1; rc=$?
  else
    soak_what="${SOAK_STEPS:-20000} steps per layer"
    SPARSEPAGE_SOAK_STEPS=${SOAK_STEPS:-20000} timeout ${SOAK_TIMEOUT:-1800} "$T" \
      --gtest_filter='ContinuousBatchingCuda.Soak' > "$OUT/soak.log" 2>&1; rc=$?
  fi
  [ $rc -eq 0 ] || failed=1
  [ $rc -eq 124 ] && soak_what="$soak_what, TIMEOUT"
  note "soak ($soak_what): rc=$rc, $(grep -E '^\[  (PASSED|FAILED)' "$OUT/soak.log" | tr '\n' ' ')"
  grep -E '^soak ' "$OUT/soak.log"
  cp "$OUT/soak.log" "$RESULTS/soak.log"
fi
if [[ $STAGES == *steps* ]]; then
  # Whole decode steps of the three layers, eager and graph-replayed (the serving loop).
  "$S" ${STEP_ARGS:-} --json "$RESULTS/steps.json" > "$OUT/steps.log" 2>&1; rc=$?
  [ $rc -eq 0 ] || failed=1
  note "step bench: rc=$rc"; grep -E "^(blocksparse|dsa|static)" "$OUT/steps.log" | cut -c1-300
  cp "$OUT/steps.log" "$RESULTS/steps.log"
fi
if [[ $STAGES == *multitoken* ]]; then
  # Multi-token steps (q_len 2 and 4) at batch 32, 32K, each beside the one-token step of a twin layer.
  for q_len in 2 4; do
    "$S" --layers blocksparse dsa --batches 32 --contexts 32768 --steps 8 --reps 5 --q-len $q_len \
      --json "$OUT/steps_q$q_len.json" > "$OUT/steps_q$q_len.log" 2>&1; rc=$?
    [ $rc -eq 0 ] || failed=1
    note "multi-token steps, q_len $q_len: rc=$rc"; grep -E "^(blocksparse|dsa)" "$OUT/steps_q$q_len.log" | cut -c1-300
  done
fi
if [[ $STAGES == *peers* ]]; then
  # FlashInfer and FlashMLA beside our kernels, same shapes, one table (scripts/peers.sh; PEERS_SHIPPED
  # names the folder `peers.sh ship` filled: peer binaries, our kernel bench, the script).
  if [ -x "${PEERS_SHIPPED:-}/peers.sh" ]; then
    OUT="$OUT/peers" "$PEERS_SHIPPED/peers.sh" run > "$OUT/peers_table.log" 2>&1; rc=$?
    [ $rc -eq 0 ] || failed=1
    note "peers side by side: rc=$rc"; sed -n '/^GQA/,$p' "$OUT/peers_table.log"
  else
    failed=1; note "peers stage asked for, but PEERS_SHIPPED holds no peers.sh (run scripts/peers.sh prepare + ship first)"
  fi
fi
if [[ $STAGES == *bench* ]]; then
  for batch in 1 32; do
    "$B" --contexts 16384,32768,65536 --batch $batch --json "$OUT/bench_blocks_b$batch.json" > "$OUT/bench_blocks_b$batch.log" 2>&1
    note "bench blocks batch $batch: rc=$?"; grep -A5 "^context" "$OUT/bench_blocks_b$batch.log"
  done
  SPARSEPAGE_SPARSE_DECODE=0 "$B" --contexts 32768 --batch 1 > "$OUT/bench_killswitch.log" 2>&1
  note "kill switch off: rc=$? $(grep 'sparse arm' "$OUT/bench_killswitch.log")"
fi
if [[ $STAGES == *kernel* ]]; then
  for cfg in "1 2048" "8 2048" "32 2048" "64 4096"; do
    set -- $cfg
    "$B" --selection random --contexts 131072 --batch $1 --rows $2 --json "$OUT/kernel_b$1.json" > "$OUT/kernel_b$1.log" 2>&1
    note "kernel batch $1 rows $2: rc=$?"; grep -A2 "^context" "$OUT/kernel_b$1.log"
  done
fi
if [[ $STAGES == *dsa* ]]; then
  # The MLA shape (128 heads, 512 + 64, V = K), 2048 random tokens of 128K.
  for batch in 1 64 128; do
    "$B" --geometry dsa --selection random --rows 2048 --contexts 131072 --batch $batch --reps 9 --steps 10 \
      --json "$OUT/dsa_b$batch.json" > "$OUT/dsa_b$batch.log" 2>&1
    note "dsa batch $batch: rc=$? $(grep -o 'fused [0-9.]* TFLOP/s (cold)' "$OUT/dsa_b$batch.log")"
    grep -A1 "^context" "$OUT/dsa_b$batch.log" | tail -1 | cut -c1-120
  done
  # The one-KV-head floor: where the fused launch starts to win at batch 1-8.
  for batch in 1 2 4 8; do
    "$B" --geometry dsa --selection random --rows 2048 --contexts 2560,3072,4096,8192,32768,131072 --batch $batch \
      --min-sparsity 0 --reps 7 --steps 10 --json "$OUT/dsa_floor_b$batch.json" > "$OUT/dsa_floor_b$batch.log" 2>&1
    note "dsa floor batch $batch: rc=$?"; grep -A7 "^context" "$OUT/dsa_floor_b$batch.log" | cut -c1-110
  done
fi
if [[ $STAGES == *sweep* ]]; then
  # Plan tuning at the latency-bound end: batch 1 and 8, random 2048 rows.
  for batch in 1 8; do
    for tune in "2 64" "1 128" "2 128" "4 64" "1 256"; do
      set -- $tune
      "$B" --selection random --contexts 131072 --batch $batch --rows 2048 --items-per-sm $1 --min-chunk $2 \
        > "$OUT/sweep_b${batch}_$1_$2.log" 2>&1
      echo "sweep batch $batch items/SM $1 min chunk $2: $(grep -A1 '^context' "$OUT/sweep_b${batch}_$1_$2.log" | tail -1 | cut -c1-110) $(grep -o '[0-9]* chunks' "$OUT/sweep_b${batch}_$1_$2.log" | head -1)"
    done
  done
fi
if [[ $STAGES == *dispatch* ]]; then
  # Crossover sweep for the policy defaults: sparsity 1.5x .. 64x of the
  # block-sparse selection (16 blocks of 128 + final = 2176 rows), batch 1 .. 64,
  # with the gate disabled so both arms always run.
  for batch in 1 4 16 64; do
    "$B" --contexts 3264,4352,8704,17408,34816,69632,139264 --batch $batch --min-sparsity 0 --reps 7 --steps 10 \
      --json "$OUT/dispatch_b$batch.json" > "$OUT/dispatch_b$batch.log" 2>&1
    note "dispatch sweep batch $batch: rc=$?"; grep -A8 "^context" "$OUT/dispatch_b$batch.log" | cut -c1-120
  done
  for topk in 1 2 4 8; do
    "$B" --contexts 8192 --batch 1 --topk-blocks $topk --min-sparsity 0 --reps 7 --steps 10 \
      --json "$OUT/floor_topk$topk.json" > "$OUT/floor_topk$topk.log" 2>&1
    echo "floor topk $topk: $(grep -A1 '^context' "$OUT/floor_topk$topk.log" | tail -1 | cut -c1-120)"
  done
fi
if [[ " $STAGES " == *" ab "* ]]; then
  # The same-run A/B against another commit: AB_DIR (default build-ab, made
  # on the development machine by scripts/ab_build.sh BASE and carried with
  # the call) holds the base's programs. AB_RUNS lists the runs, one a line:
  # a program name and its arguments (e.g. "sparse_step_bench --layers dsa
  # --batches 1 32 --contexts 32768"). Each run alternates base and head,
  # base first, AB_ROUNDS times (default 2); logs $OUT/ab_<run>_<side>_<round>.log.
  ab_dir=${AB_DIR:-build-ab}
  if [ ! -d "$ab_dir/tools" ] || [ -z "${AB_RUNS:-}" ]; then
    failed=1; note "ab: needs $ab_dir/tools (scripts/ab_build.sh BASE) and AB_RUNS"
  else
    note "ab: base $(cat "$ab_dir/base.txt" 2>/dev/null || echo '?') against this tree"
    run=0
    while IFS= read -r line; do
      [ -n "${line// }" ] || continue
      run=$((run + 1))
      read -r tool args <<< "$line"
      for round in $(seq 1 "${AB_ROUNDS:-2}"); do
        for side in base head; do
          bin="$BUILD/tools/$tool"; [ "$side" = base ] && bin="$ab_dir/tools/$tool"
          # shellcheck disable=SC2086  # the run's arguments split as written
          "$bin" $args > "$OUT/ab_${run}_${side}_${round}.log" 2>&1; rc=$?
          [ $rc -eq 0 ] || failed=1
          note "ab run $run ($tool) $side round $round: rc=$rc (log ab_${run}_${side}_${round}.log)"
        done
      done
    done <<< "$AB_RUNS"
  fi
fi
if [[ " $STAGES " == *" pytest "* ]]; then
  # tests/python (numpy and torch suites, CUDA tensors where a GPU is
  # present) over BUILD's extension for this python3 (configure BUILD with
  # -DSPARSEPAGE_PYTHON=ON and that interpreter), beside this tree's
  # package sources. PYTEST_TIMEOUT seconds (default 300).
  abi=$(python3 -c 'import sys; print(f"cpython-{sys.version_info[0]}{sys.version_info[1]}")')
  so=$(ls "$BUILD"/python/_core."$abi"-*.so 2>/dev/null | head -1)
  if [ -z "$so" ]; then
    failed=1; note "pytest: $BUILD/python holds no _core.$abi extension for this python3"
  else
    site=$(mktemp -d); cp -r python/sparsepage "$site/"; cp "$so" "$site/sparsepage/"
    PYTHONPATH=$site timeout "${PYTEST_TIMEOUT:-300}" python3 -m pytest -p no:cacheprovider -q -rs tests/python \
      > "$OUT/pytest.log" 2>&1; rc=$?
    [ $rc -eq 0 ] || failed=1
    note "pytest ($(basename "$so")): rc=$rc, $(tail -1 "$OUT/pytest.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20
  fi
fi
if [[ $STAGES == *sass* ]]; then
  cuobjdump -sass -fun '_ZN10sparsepage4cuda14partial_kernelI13__nv_bfloat16Li128ELi128ENS0_11PagedSourceEEEvNS0_13PartialParamsE' \
    "$B" > "$OUT/sass_partial_bf16_128.txt" 2>&1
  note "sass: $(grep -cE '^ +/\*[0-9a-f]{4}\*/' "$OUT/sass_partial_bf16_128.txt") instructions in the bf16 128/128 paged partial kernel"
fi
if [[ $STAGES == *profile* ]]; then
  # Kernel-level view (Nsight Compute, clocks left alone): batch 1 and batch 32.
  for batch in 1 32; do
    timeout 300 ncu --clock-control none --kernel-name-base demangled --kernel-name "regex:partial_kernel|merge_kernel" \
      --launch-skip 0 --launch-count 2 --import-source no \
      --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      --section SourceCounters --section InstructionStats --metrics smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_no_instructions,smsp__inst_executed.sum \
      "$B" --selection random --contexts 131072 --batch $batch --rows 2048 --reps 3 --steps 2 \
      > "$OUT/ncu_b$batch.log" 2>&1
    note "ncu batch $batch: rc=$?"
    grep -E "^  [a-z].*\(|Duration|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued|Theoretical Occ" "$OUT/ncu_b$batch.log" | head -30
  done
fi
tar czf "$RESULTS/gpu-logs${LOGS:+-$(basename "$LOGS")}.tar.gz" -C "$OUT" . 2>/dev/null
echo; echo "==== summary"; printf '%s\n' "${summary[@]}"
exit $failed
