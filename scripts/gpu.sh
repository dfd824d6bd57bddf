#!/usr/bin/env bash
# The one GPU entry point of jax_ep: scripts/gpu.sh STEP [STEP...]. Builds once, sources scripts/gpu_env.sh, runs
# each step's commands under time limits and goes on after a failure; one log per step and summary.txt (exit
# statuses, pass/fail lines) in $OUT (the device machine's output folder) or else gpu-logs/. Exit status 1 if any
# step failed. After any change under cuda/, nvshmem/ or xla_ffi/:   scripts/gpu.sh check
# Steps and variables: scripts/gpu.sh --help.   Print the commands, run nothing:   DRY_RUN=1 scripts/gpu.sh check
set -u
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
. scripts/gpu_env.sh

usage() { cat <<'EOF'
usage: scripts/gpu.sh STEP [STEP...]        (--help: this text)
Builds first (once per call), then runs the steps in order, each one also after a failed one; exit status 1 if any
failed. Logs in $OUT if set (the device machine's output folder), else gpu-logs/: STEP.log per step and summary.txt
(GPUs; each command's exit status, seconds, pass/fail lines; each step's status), printed as it grows. The device
machine returns 8 files of $OUT at most: up to about 6 steps per call. Environment: scripts/gpu_env.sh.
steps:
  build              python3 -m pip install --no-build-isolation --no-deps -e . -v, then import the native modules
  suite              the GPU pytest files, one process each (a kernel that traps poisons its CUDA context); on 4
                     GPUs about 700 s, more than one call: split it with SUITE_FILES (test_cuda_backend about 200 s,
                     test_low_latency about 180 s, test_low_latency_nvshmem about 100 s)
  multiprocess       tests/gpu/test_multiprocess_cuda.py (one process per GPU): its NVSHMEM cases (-k "nvshmem or
                     two_launchers or across"), then the others
  sanitize           compute-sanitizer SAN_TOOLS on tests/programs/sanitize/ SAN_PROGRAMS, the NVSHMEM ones in N
                     processes (N > 2: one sanitizer per process); with memcheck also normal_nvshmem_small with
                     JAX_EP_TEST_WIDE_SEND=1 and low_latency_small at -n 1 with JAX_EP_TEST_ALL_PEERS_REMOTE=1.
                     Exit status 99: the sanitizer reported errors
  check              = build suite multiprocess sanitize
  cmdbuf             pytest -s tests/gpu -k scan with XLA command buffers off, then FUSION,CUSTOM_CALL
  examples           examples/moe_layer.py --steps 10, then --mode low_latency
  bench              python3 -m jax_ep.bench (one process, every GPU) BENCH_ARGS
  bench-nvshmem      jax_ep.bench in N processes (launch -n N), each of BENCH_MODES through the NVLink (--nvl 8) and
                     the NVSHMEM kernels (--nvl 1: nodes of one GPU); then low-latency --nvl 1 per PUT_SWEEP value
  low-latency-ratio  low-latency NVSHMEM / NVLink time at EP2, less noisy than one bench run: REPS alternations of
                     CONFIGS, CALLS chained calls per loop; a table of medians and ratios to the first config
  low-latency-ab     low-latency bench of the tree in OLD, then of this one, each built, at EP2 with --nvl 8 and 1
  chain-ab           kernel periods of the tree in OLD against this one, one process on every GPU: both built as
                     wheels into SCRATCH, then REPS rounds of python3 -m jax_ep.bench.chain_gaps CHAIN_ARGS with
                     JAX_EP_TEST_PHASES=1, new then old (TREES="tag:dir ...": those trees instead, in that order;
                     CHAIN_PROCESSES=N: in N processes, one per GPU; a run whose host process crashes, rc 134 or
                     139, runs once more); the editable install of this tree is restored after
  shared-gpu         groups larger than the GPUs (launch --processes-per-gpu) under the CUDA MPS daemon (started as
                     a user process, stopped after): pytest -s tests/gpu/test_multiprocess_cuda.py -k SHARED_K
  shared-gpu-bench   the per-op fixed cost (T=1, jax_ep only, nodes of 8) of each of BENCH_MODES for groups of
                     SHARED_RANKS ranks under MPS (ranks / GPUs processes per GPU; at most 16 per GPU run reliably)
  first-call         python3 -m jax_ep.bench.first_call, one process and one per GPU: --op low_latency at T=1 and
                     T=128 with --mode eager, all_to_all (padded; no jax_ep), xla (control: no collective) and eager
                     with --warmup-calls 2 (first serving call after jax_ep.warmup); then normal-mode eager and lazy.
                     WARMUP_AB=1 instead: eager with warm-up ops on and off (--no-warmup-ops), XLA preallocation off
                     and on (fraction 0.5)
  cpu-suite          the CPU suite's gradient / vjp / program / error tests, on the GPUs
  signal-cost        scripts/signal_cost.cu on GPUs 0 and 1: the cost of a flag per way of ordering the data before it
  rank-loops         scripts/rank_loops.cu on GPUs 0 and 1: what each loop over a group's ranks costs, R = 8 to 256
  deepep             DeepEP V1's own tests on DEEPEP_N GPUs (the anchor on the same machine and day): a DeepEP source tree
                     in DEEPEP (e.g. `git archive 567632d | tar -x -C .gpu_tmp/deepep` from github:deepseek-ai/DeepEP,
                     carried), built in place, then tests/test_intranode.py and tests/test_low_latency.py
  buffer-export      scripts/xla_buffer_export.py with XLA's preallocation on (XLA's default), then off: whether
                     another process can map the buffers XLA hands a call (direct receive with one process per GPU)
  peer-bandwidth     scripts/peer_bandwidth.cu on every GPU: NVLink GB/s per GPU when all send to (or read from) all at
                     once, per copy method (SM stores or loads, TMA bulk copies) and blocks B = 1 to 132
variables (default):
  DRY_RUN=1  print the commands, run nothing       NO_BUILD=1  no build (the tree was built before)
  PREBUILT=DIR  where build/ is missing, copy DIR's _jax_ep_*.so into jax_ep/ instead of building
  KEEP_MODULES=1  copy the built .so files to the logs       PYTHON (python3)
  SCRATCH (/tmp/jax_ep_gpu)  bench results and per-process logs, kept out of $OUT
  N (2)  processes (= GPUs) of sanitize and bench-nvshmem     GPUS (all)  first-call's one-per-GPU runs
  LAUNCH_PREALLOCATE (true)  XLA's preallocation in bench-nvshmem and chain-ab's CHAIN_PROCESSES runs (true: receive
     pools, direct receive, as jax_ep.launch leaves it where each process has its own GPU; false: staging)
  SUITE_FILES (tests/test_native_build.py tests/gpu/test_*.py but test_multiprocess_cuda.py)  SUITE_LIMIT (300 s)
  MP_K  multiprocess as one run: pytest -k MP_K
  SAN_TOOLS (memcheck racecheck)  SAN_PROGRAMS (intranode low_latency_nvlink low_latency normal device_check)
  SAN_KERNELS (kns=nvshmem_)  --kernel-name of the NVSHMEM programs ("" = every kernel; intranode: kns=jax_ep,
     low_latency_nvlink: kns=low_latency_, both modes in one process, memcheck on GPUs 0-1; device_check: kns=device_check). Other variables pass through: JAX_EP_SANITIZE_NVL=2 with N=4 normal: the
     forward kernels of hierarchical dispatch
  BENCH_ARGS  more arguments of bench (default: its GPU defaults)
  BENCH_MODES (low_latency normal)  LOW_LATENCY_TOKENS (1,32,128)  TOKENS (4096, normal mode)  PUT_SWEEP (none)
  REPS (3)  CONFIGS (nvl8 nvl1; nvl1:BYTES = --nvl 1 with JAX_EP_LOW_LATENCY_PUT_BYTES=BYTES)  CALLS (100)  LOOPS (10)
  OLD (ab_old; e.g. `git archive REV | tar -x -C ab_old`)  ORDER (old new)  TREES (chain-ab: new:. old:$OLD)
  CHAIN_ARGS (--ll-tokens 1,128 --only
     "jax_ep LL dispatch fp8,jax_ep LL combine"; e.g. --mode normal --tokens 256,4096 --only "jax_ep dispatch bf16")
  DEEPEP (.gpu_tmp/deepep)  DEEPEP_N (every GPU)
  SHARED_K (larger_than_the_gpus)  SHARED_LIMIT (500 s)  SHARED_RANKS (16 32; 64 on 4 GPUs)  WARMUP_AB (0)  FIRST_CALL_ARGS  more args of first_call
e.g.  scripts/gpu.sh check;  N=4 SAN_PROGRAMS=normal JAX_EP_SANITIZE_NVL=2 scripts/gpu.sh sanitize
EOF
}

LOG=${OUT:-$ROOT/gpu-logs}; SUMMARY=$LOG/summary.txt; SCRATCH=${SCRATCH:-/tmp/jax_ep_gpu}
PY=${PYTHON:-python3}; N=${N:-2}; DRY=${DRY_RUN:-}; [ "$DRY" = 0 ] && DRY=
# benches in one process per GPU run as the launcher leaves them by default: XLA's preallocation on (receive pools)
LAUNCH_PREALLOCATE=${LAUNCH_PREALLOCATE:-true}
PYTEST=("$PY" -m pytest -p no:cacheprovider -q -rs)
LL_TOKENS=${LOW_LATENCY_TOKENS:-1,32,128}; SAN_KERNELS=${SAN_KERNELS-kns=nvshmem_}
# pass/fail lines: pytest's summary, compute-sanitizer's, the programs' "...: OK", the examples', errors
PASS_RE='[0-9]+ (passed|failed|errors?|skipped)|no tests ran|ERROR SUMMARY|RACECHECK SUMMARY|: OK|skipped:'
PASS_RE+='|went down|go down|decode step:|[A-Za-z]+Error:|Segmentation|Trapping'
RANK0_RE='^\[rank 0\] \|.*(jax_ep|kernel)'
DIGEST=; PREFIX=  # a step's extra summary lines: what its commands print that matches DIGEST (with PREFIX)

q() {  # the command as one line a shell can run
  local a s=; for a; do [[ $a =~ ^[A-Za-z0-9_./=:,+@%-]+$ ]] && s+="$a " || s+="'${a//\'/\'\\\'\'}' "; done
  printf '%s' "${s% }"; }
note() { if [ -n "$DRY" ]; then echo "  # $*"; else echo "$*" | tee -a "$SUMMARY"; fi; }

# run NAME LIMIT CMD...: CMD under LIMIT seconds (a function of this file: its own limits), output appended to the
# step's log; a summary line with NAME, exit status, seconds and the last pass/fail lines, then the DIGEST lines.
run() {
  local name=$1 limit=$2; shift 2
  if [ -n "$DRY" ]; then declare -F "$1" >/dev/null && "$@" || echo "  [$name, ${limit}s] $(q "$@")"; return 0; fi
  local t0=$SECONDS rc from=$(($(wc -l <"$STEP_LOG") + 1))
  echo "=== $name (limit ${limit}s): $(q "$@")" >>"$STEP_LOG"
  if declare -F "$1" >/dev/null; then "$@" >>"$STEP_LOG" 2>&1
  else timeout --kill-after=10 "$limit" "$@" >>"$STEP_LOG" 2>&1; fi
  rc=$?
  note "$name rc=$rc $((SECONDS - t0))s: $(tail -n +"$from" "$STEP_LOG" | grep -aE "$PASS_RE" | tail -3 | cut -c1-200 \
    | tr '\n' ' ')"
  [ -z "$DIGEST" ] || tail -n +"$from" "$STEP_LOG" | grep -aE "$DIGEST" | sed -e 's/^\[rank 0\] //' -e "s|^|$PREFIX|" \
    | cut -c1-220 | head -30 | tee -a "$SUMMARY"
  [ "$rc" = 0 ] || STEP_RC=1
  return "$rc"
}
step_build() {
  local DIGEST='^(-- )?jax_ep:|^(native|nvshmem):'
  if [ -n "${PREBUILT:-}" ] && ! ls -d build/cp3* >/dev/null 2>&1; then
    run prebuilt 30 cp "$PREBUILT"/_jax_ep_native*.so "$PREBUILT"/_jax_ep_nvshmem*.so jax_ep/
    export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  else
    run build 300 "$PY" -m pip install --no-build-isolation --no-deps -e . -v
    [ "${KEEP_MODULES:-0}" = 1 ] && run "keep modules" 30 sh -c 'cp build/cp3*/_jax_ep_*.so "$0"/' "$LOG"
  fi
  run "import" 120 "$PY" -c "import sys, jax_ep._native as n, jax_ep.runtime.nvshmem as m; print('native:', \
n.available(), n.load_error()); print('nvshmem:', m.availability()); sys.exit(not n.available())"
}
step_suite() {
  local f files=${SUITE_FILES:-tests/test_native_build.py $(ls tests/gpu/test_*.py | grep -v multiprocess_cuda)}
  for f in $files; do run "suite $(basename "$f" .py)" "${SUITE_LIMIT:-300}" "${PYTEST[@]}" "$f"; done
}
step_multiprocess() {
  local f=tests/gpu/test_multiprocess_cuda.py nv="nvshmem or two_launchers or across"
  local DIGEST='^\$|RESULT (runtime|teams|mismatch)'
  if [ -n "${MP_K:-}" ]; then run "multiprocess -k $MP_K" 460 "${PYTEST[@]}" -s "$f" -k "$MP_K"; return; fi
  run "multiprocess nvshmem cases" 240 "${PYTEST[@]}" -s "$f" -k "$nv"
  run "multiprocess other cases" 220 "${PYTEST[@]}" -s "$f" -k "not ($nv)"
}

# san NAME TOOL KERNELS NPROC ENV PROG ARGS...: PROG in NPROC processes over NVSHMEM under compute-sanitizer
san() {
  local name=$1 tool=$2 kf=$3 n=$4 env=$5; shift 5
  local cs=(compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 ${kf:+--kernel-name "$kf"})
  if [ "$n" -gt 2 ]; then
    local DIGEST='^process [0-9]+:'; run "$name" 170 san_per_process "$n" "$env" "${cs[@]}" -- "$@"
  else
    run "$name" 120 env JAX_EP_TRANSPORT=nvshmem $env "${cs[@]}" "$PY" -m jax_ep.launch -n "$n" --timeout 110 "$@"
  fi
}
# One compute-sanitizer following all N > 2 children of `jax_ep.launch -n N` segfaulted (rc 139, N=4): here N
# launchers run as on N hosts (-n 1 --num-hosts N --host-index h, CUDA_VISIBLE_DEVICES=h), each with its own.
san_per_process() {  # NPROC ENV SANITIZER... -- PROG ARGS...
  local n=$1 env=$2 cs=() h p rc=0 port=PORT pids=(); shift 2
  while [ "$1" != -- ]; do cs+=("$1"); shift; done; shift
  [ -n "$DRY" ] || port=$("$PY" -c "from jax_ep.launch.plan import free_port; print(free_port())") || return 1
  for h in $(seq $((n - 1)) -1 0); do  # host 0 (the coordinator) last, as the two-launcher test does
    local cmd=(env CUDA_VISIBLE_DEVICES=$h JAX_EP_TRANSPORT=nvshmem $env timeout --kill-after=10 150 "${cs[@]}"
      "$PY" -m jax_ep.launch -n 1 --num-hosts "$n" --host-index "$h" --coordinator "127.0.0.1:$port" --timeout 140 "$@")
    if [ -n "$DRY" ]; then echo "  [process $h, in parallel] $(q "${cmd[@]}")"; continue; fi
    "${cmd[@]}" >"$SCRATCH/san_h$h.log" 2>&1 & pids+=($!)
  done
  [ -n "$DRY" ] && return 0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  for h in $(seq 0 $((n - 1))); do echo "--- process $h"; cat "$SCRATCH/san_h$h.log"; done
  for h in $(seq 0 $((n - 1))); do echo "process $h: $(grep -aE 'SUMMARY|: OK|Trapping|Segmentation|Error' \
    "$SCRATCH/san_h$h.log" | tail -2 | tr '\n' ' ')"; done
  return "$rc"
}
step_sanitize() {
  local tool prog mode P=tests/programs/sanitize tools=" ${SAN_TOOLS:-memcheck racecheck} "
  local progs=" ${SAN_PROGRAMS:-intranode low_latency_nvlink low_latency normal device_check} "
  for tool in $tools; do
    for prog in $progs; do
      case $prog in
        intranode)  # one process, R = min(2, GPUs); its harness lives in tests/gpu
          run "$tool intranode" 150 env XLA_FLAGS=--xla_gpu_enable_command_buffer= \
            PYTHONPATH="$ROOT/tests/gpu${PYTHONPATH:+:$PYTHONPATH}" compute-sanitizer --tool "$tool" \
            --report-api-errors no --error-exitcode 99 --kernel-name kns=jax_ep "$PY" $P/intranode_small.py ;;
        low_latency) san "$tool low_latency n$N" "$tool" "$SAN_KERNELS" "$N" "" $P/low_latency_small.py nvshmem ;;
        low_latency_nvlink)  # one process, the NVLink kernels of both modes: racecheck on every GPU, memcheck on
          # GPUs 0-1 (compute-sanitizer's memcheck segfaults, itself, on this program with 4 GPUs)
          local gpus=${CUDA_VISIBLE_DEVICES:-}
          [ "$tool" != memcheck ] || gpus=${gpus:-0,1}
          for mode in per_expert per_rank; do
            run "$tool low_latency_nvlink $mode" 150 env ${gpus:+CUDA_VISIBLE_DEVICES=$gpus} compute-sanitizer \
              --tool "$tool" --report-api-errors no --error-exitcode 99 --kernel-name kns=low_latency_ \
              "$PY" $P/low_latency_small.py $mode
          done ;;
        normal) san "$tool normal n$N" "$tool" "$SAN_KERNELS" "$N" "" $P/normal_nvshmem_small.py ;;
        device_check) san "$tool device_check n$N" "$tool" kns=device_check "$N" "" $P/device_check.py ;;
        *) note "unknown sanitize program '$prog' (intranode low_latency_nvlink low_latency normal device_check)"
           STEP_RC=1 ;;
      esac
    done
  done
  [[ $tools == *" memcheck "* ]] || return 0
  # the NVSHMEM normal send kernel's 32-slot instance (R > 8) at R = N, through a test hook
  [[ $progs == *" normal "* ]] && san "memcheck normal wide-send n$N" memcheck "$SAN_KERNELS" "$N" \
    JAX_EP_TEST_WIDE_SEND=1 $P/normal_nvshmem_small.py
  # one process whose peers all count as remote: the NVSHMEM put path with one GPU
  [[ $progs == *" low_latency "* ]] && san "memcheck low_latency n1 all-remote" memcheck "$SAN_KERNELS" 1 \
    JAX_EP_TEST_ALL_PEERS_REMOTE=1 $P/low_latency_small.py nvshmem
  return 0
}
step_cmdbuf() {
  local flags DIGEST='command buffers in|scan:'
  for flags in "" FUSION,CUSTOM_CALL; do
    run "command buffers ${flags:-off}" 120 env XLA_FLAGS="--xla_gpu_enable_command_buffer=$flags" \
      "${PYTEST[@]}" -s tests/gpu -k scan
  done
}
step_examples() { run "moe_layer normal" 120 "$PY" examples/moe_layer.py --steps 10
  run "moe_layer low_latency" 120 "$PY" examples/moe_layer.py --mode low_latency; }
step_bench() { local DIGEST='^\||kernel\)'; run bench 400 "$PY" -m jax_ep.bench --out "$SCRATCH"/bench ${BENCH_ARGS:-}
}
step_bench_nvshmem() {
  local mode nvl bytes shape DIGEST=$RANK0_RE PREFIX=
  for mode in ${BENCH_MODES:-low_latency normal}; do
    # low-latency: every contender, with its kernel-time phases; normal mode: jax_ep only
    [ "$mode" = low_latency ] && shape=(--ll-tokens "$LL_TOKENS") || shape=(--tokens "${TOKENS:-4096}" --only jax_ep)
    for nvl in 8 1; do
      PREFIX="$mode nvl=$nvl: "
      run "$mode nvl$nvl ep$N" 200 env NVSHMEM_SYMMETRIC_SIZE=12G XLA_PYTHON_CLIENT_PREALLOCATE="$LAUNCH_PREALLOCATE" \
        "$PY" -m jax_ep.launch -n "$N" -m jax_ep.bench \
        --mode "$mode" "${shape[@]}" --loops 15 --nvl $nvl --out "$SCRATCH/bench_${mode}_nvl$nvl"
    done
  done
  for bytes in ${PUT_SWEEP:-}; do
    PREFIX="put_bytes=$bytes nvl=1: "
    run "low_latency put$bytes nvl1 ep$N" 200 env NVSHMEM_SYMMETRIC_SIZE=12G JAX_EP_LOW_LATENCY_PUT_BYTES="$bytes" \
      "$PY" -m jax_ep.launch -n "$N" -m jax_ep.bench --mode low_latency --ll-tokens "$LL_TOKENS" --only jax_ep \
      --loops 15 --nvl 1 --out "$SCRATCH/bench_put$bytes"
  done
}
step_low_latency_ratio() {
  local rep cfg nvl put res=$SCRATCH/ratio configs=${CONFIGS:-nvl8 nvl1}
  [ -n "$DRY" ] || { rm -rf "$res"; mkdir -p "$res"; }
  for rep in $(seq 1 "${REPS:-3}"); do
    for cfg in $configs; do  # nvl8 | nvl1 | nvl1:BYTES
      nvl=${cfg%%:*}; nvl=${nvl#nvl}; [[ $cfg == *:* ]] && put=${cfg#*:} || put=
      run "rep $rep $cfg" 150 env NVSHMEM_SYMMETRIC_SIZE=12G ${put:+JAX_EP_LOW_LATENCY_PUT_BYTES=$put} "$PY" -m \
        jax_ep.launch -n 2 -m jax_ep.bench --mode low_latency --ll-tokens "$LL_TOKENS" --only jax_ep \
        --calls "${CALLS:-100}" --loops "${LOOPS:-10}" --nvl "$nvl" --out "$res/${rep}_$cfg"
    done
  done
  local DIGEST='^\|'; run "ratio table" 60 "$PY" scripts/low_latency_ratio_table.py "$res" $configs
}
step_low_latency_ab() {
  local tag dir nvl old=${OLD:-ab_old} DIGEST=$RANK0_RE PREFIX=
  for tag in ${ORDER:-old new}; do
    dir=$ROOT; [ "$tag" = old ] && { [[ $old == /* ]] && dir=$old || dir=$ROOT/$old; }
    run "build $tag" 300 env -C "$dir" "$PY" -m pip install --no-build-isolation --no-deps -e .
    for nvl in 8 1; do
      PREFIX="$tag nvl=$nvl: "
      run "$tag nvl$nvl" 150 env -C "$dir" NVSHMEM_SYMMETRIC_SIZE=12G "$PY" -m jax_ep.launch -n 2 -m jax_ep.bench \
        --mode low_latency --ll-tokens "$LL_TOKENS" --loops 15 --nvl $nvl --out "$SCRATCH/ab_${tag}_nvl$nvl"
    done
  done
  BUILT=  # the tree installed last may be OLD's
}
ab_wheel() {  # TAG DIR: DIR built as a wheel, installed into SCRATCH/site_TAG (no editable install involved)
  if [ -n "$DRY" ]; then echo "  [wheel $1] pip wheel $2 -> $SCRATCH/wheels_$1, pip install --target $SCRATCH/site_$1"
    return 0; fi
  rm -rf "$SCRATCH/wheels_$1" "$SCRATCH/site_$1"
  env -C "$2" "$PY" -m pip wheel --no-build-isolation --no-deps -w "$SCRATCH/wheels_$1" . &&
    "$PY" -m pip install -q --no-deps --no-compile --target "$SCRATCH/site_$1" "$SCRATCH/wheels_$1"/jax_ep-*.whl
}
step_chain_ab() {
  local tag dir tree rep old=${OLD:-ab_old} DIGEST='period|^(\[rank 0\] )?\| [a-z_]*kernel \| [0-9]' PREFIX=
  local -a chain_args=(--ll-tokens 1,128 --only "jax_ep LL dispatch fp8,jax_ep LL combine") tags=() launch=()
  # CHAIN_PROCESSES=N: chain_gaps in N processes, one per GPU (jax_ep.launch; rank 0's tables in the summary)
  [ -z "${CHAIN_PROCESSES:-}" ] ||
    launch=(env NVSHMEM_SYMMETRIC_SIZE="${NVSHMEM_SYMMETRIC_SIZE:-12G}" XLA_PYTHON_CLIENT_PREALLOCATE="$LAUNCH_PREALLOCATE"
            "$PY" -m jax_ep.launch -n "$CHAIN_PROCESSES")
  # CHAIN_ARGS is read as shell words, so quotes group an argument: --only 'jax_ep LL dispatch fp8,jax_ep LL combine'.
  # It is evaluated: $(...) or ; inside it would run (it is the caller's own environment)
  [ -z "${CHAIN_ARGS:-}" ] || eval "chain_args=($CHAIN_ARGS)"
  [[ $old == /* ]] || old=$ROOT/$old
  # TREES: "tag:dir ..." (dirs relative to the repository root), each built as a wheel and timed in turn, in order
  for tree in ${TREES:-new:. old:$old}; do
    tag=${tree%%:*} dir=${tree#*:}
    [[ $dir == /* ]] || dir=$ROOT/$dir
    run "wheel $tag" 300 ab_wheel "$tag" "$dir" || return
    tags+=("$tag")
  done
  run "uninstall editable" 60 "$PY" -m pip uninstall -y -q jax_ep  # it would shadow PYTHONPATH
  for rep in $(seq 1 "${REPS:-2}"); do
    for tag in "${tags[@]}"; do
      PREFIX="$tag $rep: "
      local -a cmd=(env -C "$SCRATCH" PYTHONPATH="$SCRATCH/site_$tag" JAX_EP_TEST_PHASES=1 "${launch[@]:-$PY}" -m
                    jax_ep.bench.chain_gaps "${chain_args[@]}")
      # a host abort or segfault of chain_gaps (rc 134 / 139; seen now and then in the profiler, never tied to a
      # tree) gets one more run, so the round still has figures; the crash stays in the summary and the step's status
      run "chain_gaps $tag $rep" 150 "${cmd[@]}" || { [[ $? =~ ^(134|139)$ ]] && run "chain_gaps $tag $rep again" 150 "${cmd[@]}"; }
    done
  done
  PREFIX=; run "restore editable" 300 "$PY" -m pip install --no-build-isolation --no-deps -e .
}
MPS=
stop_mps() {
  [ -z "$MPS" ] || run "mps stop" 30 sh -c 'echo quit | "$0"' "$MPS"; MPS=
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
start_mps() {  # the CUDA MPS daemon as a user process (no GPU setting changes); MPS empty when there is none
  local ctl; ctl=$(command -v nvidia-cuda-mps-control) || { [ -n "$DRY" ] && ctl=nvidia-cuda-mps-control; }
  note "mps control: ${ctl:-none}"
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/jax_ep_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/jax_ep_mps_log
  if [ -n "$ctl" ]; then
    [ -n "$DRY" ] || mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    run "mps start" 30 "$ctl" -d && MPS=$ctl
  fi
}
step_shared_gpu() {
  start_mps
  local DIGEST='^\$|RESULT (normal|low_latency|done) |FAILED' k=${SHARED_K:-larger_than_the_gpus}
  run shared "${SHARED_LIMIT:-500}" "${PYTEST[@]}" -s tests/gpu/test_multiprocess_cuda.py -k "$k"
  DIGEST=; stop_mps
}
step_shared_gpu_bench() {  # the per-op fixed cost (T=1) as R grows: groups of SHARED_RANKS ranks under MPS
  local r gpus per mode DIGEST=$RANK0_RE PREFIX=
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU '); [ "$gpus" -gt 0 ] 2>/dev/null || gpus=$N
  start_mps
  for r in ${SHARED_RANKS:-16 32}; do
    per=$(( (r + gpus - 1) / gpus ))
    for mode in ${BENCH_MODES:-low_latency normal}; do
      PREFIX="ep$r ($per per GPU) $mode: "
      run "ep$r $mode" 240 "$PY" -m jax_ep.launch -n "$r" --processes-per-gpu "$per" --timeout 230 -m jax_ep.bench \
        --mode "$mode" --tokens 1 --ll-tokens 1 --experts 256 --ll-experts 256 --only jax_ep --nvl 8 --loops 5 \
        --out "$SCRATCH/shared_bench_ep${r}_$mode"
    done
  done
  stop_mps
}
fc() {  # NAME ENV ARGS...: jax_ep.bench.first_call in one process, then one per GPU (FC_GPUS)
  local name=$1 env=$2; shift 2
  run "one process $name" 120 env $env "$PY" -m jax_ep.bench.first_call "$@" ${FIRST_CALL_ARGS:-}
  run "one per GPU $name" 120 env $env "$PY" -m jax_ep.launch -n "$FC_GPUS" --timeout 110 -m jax_ep.bench.first_call \
    "$@" ${FIRST_CALL_ARGS:-}
}
step_first_call() {
  local pre ops t m DIGEST='PREWARM|FIRST_CALL|^\| |^\[rank 0\] \| '
  FC_GPUS=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')}; [ "$FC_GPUS" -gt 0 ] 2>/dev/null || FC_GPUS=$N
  if [ "${WARMUP_AB:-0}" = 1 ]; then  # what initialize's warm-up execution buys, XLA's preallocation off and on
    for pre in false "true XLA_PYTHON_CLIENT_MEM_FRACTION=0.5"; do for ops in "" --no-warmup-ops; do
      fc "eager PREALLOCATE=$pre ${ops:-warmup-ops}" "XLA_PYTHON_CLIENT_PREALLOCATE=$pre" --mode eager $ops; done; done
    return
  fi
  # the decode-sized op: jax_ep against the padded all_to_all program and the XLA control, and the first serving
  # call after jax_ep.warmup (20 fresh processes of 6-15 s each)
  for t in 1 128; do
    for m in eager all_to_all xla; do
      fc "low_latency T=$t $m" "" --op low_latency --tokens "$t" --mode "$m"
    done
    fc "low_latency T=$t eager warmup-calls=2" "" --op low_latency --tokens "$t" --mode eager --warmup-calls 2
  done
  for m in eager lazy; do fc "normal $m" "" --mode $m; done
}
step_cpu_suite() { run "cpu suite" 240 "${PYTEST[@]}" tests/test_{gradients,vjp_rules,programs,errors}.py; }
step_signal_cost() { local DIGEST='round trip'
  run "signal cost" 120 bash -c "nvcc -O3 -arch=sm_90 -Icuda -Icuda/include -o '$SCRATCH/signal_cost' \
    scripts/signal_cost.cu && CUDA_VISIBLE_DEVICES=0,1 '$SCRATCH/signal_cost'"; }
step_rank_loops() { local DIGEST='^\| [0-9]|rank_loops:'
  run "rank loops" 120 bash -c "nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -Icuda -Icuda/include -o \
    '$SCRATCH/rank_loops' scripts/rank_loops.cu && CUDA_VISIBLE_DEVICES=0,1 '$SCRATCH/rank_loops'"; }
step_buffer_export() { local DIGEST='export|imported|second process|no allocation'
  local p
  for p in true false; do
    run "buffer export, preallocation $p" 120 env XLA_PYTHON_CLIENT_PREALLOCATE=$p "$PY" scripts/xla_buffer_export.py
  done
}
step_peer_bandwidth() { local DIGEST='^\| [a-z]|peer_bandwidth:'
  run "peer bandwidth" 120 bash -c "nvcc -O3 -std=c++17 -arch=sm_90 -Icuda -Icuda/include -o \
    '$SCRATCH/peer_bandwidth' scripts/peer_bandwidth.cu && '$SCRATCH/peer_bandwidth'"; }
step_deepep() {  # DeepEP's build needs CCCL's headers on the include path (CUDA 13 moved them)
  local dir=${DEEPEP:-$ROOT/.gpu_tmp/deepep} n=${DEEPEP_N:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
  local DIGEST='Best|avg_t|send/recv'
  [[ $dir == /* ]] || dir=$ROOT/$dir
  run "deepep build" 420 env -C "$dir" CPATH=/usr/local/cuda/include/cccl MAX_JOBS=${MAX_JOBS:-8} "$PY" setup.py \
    build_ext --inplace || return
  run "deepep intranode" 300 env -C "$dir" PYTHONPATH="$dir" "$PY" tests/test_intranode.py --num-processes "$n"
  run "deepep low latency" 200 env -C "$dir" PYTHONPATH="$dir" "$PY" tests/test_low_latency.py --num-processes "$n"
}
do_step() {  # STEP: its commands, its log, its status line
  local s=$1 t0=$SECONDS; STEP_RC=0; STEP_LOG=$LOG/$s.log
  [ "$s" = build ] && BUILT=1  # once per call, also when it fails
  if [ -n "$DRY" ]; then echo "== $s"; else echo "== $s $(date -u +%FT%TZ)" >>"$STEP_LOG"; note "-- $s"; fi
  "step_${s//-/_}"
  [ -n "$DRY" ] && return; note "STEP $s rc=$STEP_RC $((SECONDS - t0))s"; [ "$STEP_RC" = 0 ] || FAILED+=("$s")
}

case ${1:-} in -h|--help|help) usage; exit 0 ;; "") usage >&2; exit 2 ;; esac
STEPS=()
for s in "$@"; do
  case $s in
    check) STEPS+=(build suite multiprocess sanitize) ;;
    build|suite|multiprocess|sanitize|cmdbuf|examples|bench|bench-nvshmem) STEPS+=("$s") ;;
    low-latency-ratio|low-latency-ab|chain-ab|shared-gpu|shared-gpu-bench|first-call|cpu-suite) STEPS+=("$s") ;;
    signal-cost|rank-loops|peer-bandwidth|buffer-export|deepep) STEPS+=("$s") ;;
    *) echo "scripts/gpu.sh: unknown step '$s' (scripts/gpu.sh --help)" >&2; exit 2 ;;
  esac
done
BUILT=; [ "${NO_BUILD:-0}" = 1 ] && BUILT=1; FAILED=(); trap stop_mps EXIT
if [ -n "$DRY" ]; then
  echo "# DRY_RUN: logs would go to $LOG; environment:" $(env | grep -E '^(NVSHMEM_|NCCL_|XLA_|CUDA_)' | sort)
else
  mkdir -p "$LOG" "$SCRATCH" || exit 2
  { echo "=== scripts/gpu.sh $* $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null)"
    nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1
    nvidia-smi topo -m 2>/dev/null | head -9
    timeout 120 "$PY" -c "import jax, jaxlib; print('jax/jaxlib', jax.__version__, jaxlib.__version__, jax.devices())" \
      2>&1 | tail -1; } | tee -a "$SUMMARY"
fi
for s in "${STEPS[@]}"; do
  if [ "$s" = build ]; then [ -n "$BUILT" ] && { note "build: already built in this call (or NO_BUILD=1)"; continue; }
  elif [ -z "$BUILT" ]; then do_step build; fi
  do_step "$s"
done
[ -n "$DRY" ] && exit 0
note "=== scripts/gpu.sh $*: ${#FAILED[@]} failed step(s)${FAILED[*]:+: ${FAILED[*]}}"
[ ${#FAILED[@]} = 0 ]
