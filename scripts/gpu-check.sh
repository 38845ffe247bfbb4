#!/usr/bin/env bash
# Run mpigpu's GPU checks on a GPU machine, in one call, under both MPIs:
#   the image's Open MPI (not CUDA-aware: host, nccl, ipc) and a CUDA-aware Intel MPI (also cuda-aware).
#
#   source .gpu-carry/env.sh; scripts/gpu-check.sh [STAGE ...]
#
# Stages (default: all, in this order):
#   env        GPUs, topology, package versions
#   info       python -m mpigpu.info under each MPI
#   tests      the test suite (GPU tests required: MPIGPU_REQUIRE_GPU=1) with 2 and all GPUs, each MPI
#   per_process  several GPUs per process (mpigpu.multi; needs 2 GPUs): tests/gpu/test_per_process_gpu.py under
#              Open MPI -n 1 (one process, both GPUs) and -n 2, Intel MPI -n 2; mpigpu.average --devices-per-rank 2
#              (-n 1: auto, nccl, host) and --devices-per-rank 1 (-n 2: auto) at 16M; scripts/per_process_bench.py
#              in layouts 1x2 (-n 1) and 2x1 (-n 2), JSON in $OUT, merged into
#              $OUT/gpus-per-process-<gpu>x<n>-<date>.txt; tests/gpu/test_jax_per_device_gpu.py under Open MPI
#              -n 1; scripts/jax_step_bench.py --local-devices (one process,
#              both GPUs; JSON in $OUT; JAX_STEP=0 skips it). At most PER_PROCESS_LIMIT seconds (default 420)
#   average    python -m mpigpu.average with every backend, each MPI; forced cuda-aware under Open MPI must
#              fail cleanly (non-zero exit, no core dump)
#   shared     two ranks sharing one GPU (MPIGPU_ALLOW_SHARED_GPU=1): host staging, training and torch.distributed tests, DDP's sample,
#              the multi-rank GPU coverage a one-GPU machine can give
#   serial     GPU tests that start their own mpirun (bad input, failures) and the samples
#   sanitize   compute-sanitizer memcheck/racecheck/synccheck over the ipc kernel (2 ranks)
#   bench      the benchmark, 8 B..1 GiB, with --tune, under Open MPI; ipc eager vs CUDA graph vs raw NCCL
#   bench_impi cuda-aware beside MPI_Allreduce on device buffers under Intel MPI, 16 MiB..1 GiB
#   usercall   issue 14's table under Open MPI: allreduce(t) and the persistent request req() (auto, nccl, ipc)
#              beside torch.distributed (NCCL) and raw NCCL, float32 sum in place, 8 B..1 GiB, torch tensors;
#              JSON and plot in $OUT; then scripts/call_cost.py --framework torch at 8 B and 64 KiB (~3 min)
#   collectives  issues 16 and 36 (not in the default list: name it): one job, python -m mpigpu.bench --collective all:
#              mpigpu.allreduce(t) (and its req()), reduce_scatter(t, "sum", out=o), alltoall(t), broadcast(t, root=0)
#              and allgather(t) under auto and each backend that has it (nccl, host, ipc, cuda-aware where the MPI is
#              CUDA-aware), beside raw NCCL and torch.distributed's own calls (NCCL) on tensors made once, float32 on
#              torch tensors, 8 B (4 B x GPUs) .. 256 MiB, 7 rounds, paths interleaved round by round, under Open MPI;
#              $OUT/collectives/<gpu>x<n>-<collective>-<date>.json per collective, the table of all five
#              (<gpu>x<n>-collectives-<date>.md, also copied beside summary.txt) and a plot; then the Horovod
#              layer's per-call row (scripts/hvd_call_bench.py --device gpu, 8 B/64 KiB/1 MiB, JSON beside them).
#              Expected ~2-3 min on 2 x H100 (an estimate: not yet timed there), at most COLLECTIVES_LIMIT (default
#              300) + HVD_CALL_LIMIT (default 90) seconds; COLL_TIME (default 4) s bounds a size
#   retest     RETEST="pytest paths" under both MPIs (a quick re-check after a fix; RETEST_LIMIT seconds each)
#   soak       thousands of random verified calls on GPU arrays; the cost of the argument check at 8 B
#   soak_repeat  issue 46 (not in the default list: name it): the soak's memory. One soak with only the largest
#              calls as warm-up and empty kernel caches (rank 0's RSS at each variant first met), then SOAK_RUNS
#              (default 10) soaks in a row as the soak stage runs them, seed SOAK_SEED (default 1147368330),
#              SOAK_CALLS calls; each step's line ends with its RSS growth (~2-3 min)
#   train      scripts/training-figures.sh: bench_training for the MLP (+ fusion), ResNet-50, GPT-2 beside DDP,
#              rows interleaved, GPT-2 checked bitwise with deterministic kernels; then the timeline of ResNet-50
#              with BackwardAverager (scripts/timeline_step.py), and GPT-2's: checked complete, merged, one step as a PNG
#   timeline   (not in the default list; part of train) the two timelines alone
#   hvd        Horovod's own test/parallel/test_torch.py as one pytest session on every GPU under Open MPI,
#              from .hvd-suite (scripts/hvd-suite.sh HOROVOD_CHECKOUT prepares it; carry it along)
#   hvd_synth  issue 37 (not in the default list: name it): Horovod's pytorch_synthetic_benchmark.py, unchanged, on
#              mpigpu's Horovod layer beside DDP (python -m mpigpu.bench.synthetic) through scripts/hvd_synthetic.py,
#              Open MPI, 2 GPUs, ResNet-50 batch 32 fp32, 5 warm-up batches, 5 iterations of 10 batches, 2 runs of
#              each side alternated (hvd ddp ddp hvd); JSON in $OUT. PASS when every run completes and prints its
#              img/sec (the goal, hvd >= 1.1 x DDP in every pair, is reported, not asserted). Needs .hvd-suite
#              (scripts/hvd-suite.sh HOROVOD_CHECKOUT; carry it) and torchvision. Expected ~1 min on 2 x H100 (an
#              estimate: not yet timed there), at most HVD_SYNTH_LIMIT (default 150) seconds
#   jax        issue 23 (not in the default list: name it): mpigpu.jax.init() binds JAX to each rank's GPU under
#              Open MPI (tests/gpu/test_jax_gpu.py alone, so init runs before JAX starts), samples/jax_step.py
#              under both MPIs, scripts/jax_step_bench.py (JSON with machine, versions and goals in $OUT; JAX_STEP=0
#              skips it) (~4 min, at most 9)
#   nodes      issue 48 goal 6 (not in the default list: name it; needs 2 GPUs, else a SKIP line): NCCL across two
#              MPI nodes on one machine: MPICH's fork launcher with named hosts (nodeA:G/2,nodeB:G/2; the wheel
#              .gpu-carry/mpich/*.whl unpacked into a private directory), every rank through scripts/node-rank.sh
#              (its node's NCCL_HOSTID, its own GPU), so that NCCL takes its network transport: mpigpu.info (2 nodes,
#              ipc unavailable, auto never ipc), NCCL_DEBUG shows NET and no P2P/SHM between the nodes,
#              tests/gpu/test_nodes_gpu.py and test_collectives_gpu.py, mpigpu.average per backend, and a short
#              bench (auto, nccl, host: node-shared memory then MPI between nodes, raw NCCL) on two nodes beside
#              the same on one node; JSON in $OUT. Expected ~4 min, at most NODES_LIMIT (default 420) seconds
# Logs go to $OUT (or ./gpu-results): summary.txt, and logs.tgz with one log per step (pytest steps: one
# log per rank, NAME.rank<r>.log). Under each failed pytest step the summary names the failed tests
# and, for a step that stalled, the test each rank was in.
# Exit status: non-zero if any step failed. The summary is printed last.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-results}
LOGS="$OUT/logs"
mkdir -p "$LOGS"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
export MPIGPU_REQUIRE_GPU=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX shares each GPU with CuPy and torch in the tests
# the kernel cache: the caller's MPIGPU_CACHE_DIR, else a private directory for this run only (a fixed
# path under a shared /tmp could be created first by another user: mpigpu would refuse it)
if [ -z "${MPIGPU_CACHE_DIR:-}" ]; then
  MPIGPU_CACHE_DIR=$(mktemp -d "${TMPDIR:-/tmp}/mpigpu-cache.XXXXXX") || { echo "mktemp -d failed"; exit 1; }
  trap 'rm -rf "$MPIGPU_CACHE_DIR"' EXIT
fi
export MPIGPU_CACHE_DIR
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "$NGPU" -ge 1 ] || { echo "no GPU visible (nvidia-smi -L)"; exit 1; }
PY=${PYTHON:-python3}
# result files are named by the GPU model (h100x1, h200x2, ...): the machines lent differ from day to day
GPU_TAG=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1 | grep -oiE '[ABHL][0-9]{2,3}' | head -n 1 | tr '[:upper:]' '[:lower:]')
GPU_TAG=${GPU_TAG:-gpu}
failures=0
# shellcheck disable=SC1091
declare -F use_impi >/dev/null || { [ -f .gpu-carry/env.sh ] && source .gpu-carry/env.sh; }
declare -F use_impi >/dev/null || { echo "source .gpu-carry/env.sh first (it defines use_impi)"; exit 1; }
export -f use_impi

# step NAME LIMIT EXPECT COMMAND...: run with a time limit, log to $LOGS/NAME.log, record the outcome.
# EXPECT is 0 (must succeed) or "fail" (must exit non-zero without a signal or core dump).
# GPU_CHECK_DEADLINE (seconds, optional): steps are shortened or skipped so that the whole run,
# including packing the logs, ends within it (a lease's call limit).
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_DEADLINE:-100000} - 15 ))
step() {
  local name=$1 limit=$2 expect=$3; shift 3
  local start end rc verdict left
  start=$(date +%s)
  left=$((DEADLINE - start))
  if [ "$left" -lt 20 ]; then
    printf '%-4s %-38s (no time left before GPU_CHECK_DEADLINE)\n' SKIP "$name" | tee -a "$SUMMARY"
    failures=$((failures + 1))
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo ">>> $name: $*" | tee -a "$LOGS/$name.log" >/dev/null
  rm -f .pytest-rank*.log
  timeout -k 10 "$limit" bash -c "$*" >>"$LOGS/$name.log" 2>&1
  rc=$?
  collect_rank_logs "$name"
  end=$(date +%s)
  if [ "$expect" = fail ]; then
    if [ "$rc" -ne 0 ] && [ "$rc" -lt 124 ] && ! ls core* >/dev/null 2>&1; then verdict=PASS; else verdict=FAIL; fi
  else
    if [ "$rc" -eq 0 ]; then verdict=PASS; else verdict=FAIL; fi
  fi
  [ "$verdict" = FAIL ] && failures=$((failures + 1))
  printf '%-4s %-38s rc=%-3s %4ss  %s\n' "$verdict" "$name" "$rc" "$((end - start))" \
    "$(grep -aE 'passed|failed|PASS|FAIL|error' "$LOGS/$name.log" | tail -n 1 | cut -c1-110)" | tee -a "$SUMMARY"
  [ "$verdict" = FAIL ] && name_failures "$name"
}

# pytest under mpirun: rank 0 writes to the step's log, rank r > 0 to .pytest-rank<r>.log in the checkout
# (tests/conftest.py); keep each rank's log with the step's, and name what failed or stalled.
collect_rank_logs() {
  local name=$1 f r
  for f in .pytest-rank*.log; do
    [ -f "$f" ] || continue
    r=${f#.pytest-rank}; r=${r%.log}
    mv "$f" "$LOGS/$name.rank$r.log"
  done
}
name_failures() {
  local name=$1 f last
  for f in "$LOGS/$name.log" "$LOGS/$name".rank*.log; do
    [ -f "$f" ] || continue
    grep -aE '^(FAILED|ERROR) ' "$f" | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-160 | sort -u | head -n 20 | sed 's/^/       /' >>"$SUMMARY"
    grep -aqE '(passed|failed|error)(,| in )' "$f" && continue  # the session ended: nothing stalled here
    last=$(grep -aoE '^[^ ]+::[^ ]+' "$f" | tail -n 1)
    [ -n "$last" ] && echo "       stalled or killed in: $last ($(basename "$f"))" >>"$SUMMARY"
  done
}

OMPI="mpirun --allow-run-as-root --oversubscribe --bind-to none"
IMPI="use_impi; mpiexec"
declare -A LAUNCH=([ompi]="$OMPI" [impi]="$IMPI")

stage_env() {
  step env 60 0 "nvidia-smi -L; nvidia-smi topo -m; $PY -m pip list 2>/dev/null | grep -iE 'cupy|cuda|torch|jax|numba|mpi4py|numpy|ml.dtypes|nccl|pytest'; mpirun --version | head -1"
}

stage_info() {
  for mpi in ompi impi; do
    step "info-$mpi" 120 0 "${LAUNCH[$mpi]} -n $NGPU $PY -m mpigpu.info"
  done
}

stage_tests() {
  local counts="2 $NGPU"
  [ "$NGPU" -lt 2 ] && counts=1
  [ "$NGPU" -eq 2 ] && counts=2
  for mpi in ompi impi; do
    for n in $counts; do
      local paths="tests/gpu"
      # the whole MPI suite (CPU and GPU) at full size under the image's MPI; the GPU tests under both
      # (IMPI_TESTS / OMPI_TESTS: other paths for Intel MPI / the full-size Open MPI run; TESTS_LIMIT: seconds per run)
      [ "$mpi" = impi ] && paths=${IMPI_TESTS:-tests/gpu}
      [ "$n" = "$NGPU" ] && [ "$mpi" = ompi ] && paths=${OMPI_TESTS:-tests}
      step "tests-$mpi-$n" "${TESTS_LIMIT:-300}" 0 "export MPIGPU_TIMEOUT=120; ${LAUNCH[$mpi]} -n $n $PY -m pytest -v -rfE --color=no --with-mpi --only-mpi $paths -p no:cacheprovider"
    done
  done
}

stage_per_process() {  # several GPUs per process (mpigpu.multi): one process x 2 GPUs beside 2 processes x 1 GPU
  if [ "$NGPU" -lt 2 ]; then
    printf '%-4s %-38s (needs 2 GPUs, this machine has %s)\n' SKIP per_process "$NGPU" | tee -a "$SUMMARY"
    return
  fi
  # the stage's own deadline (dynamic scope: step() reads it), within GPU_CHECK_DEADLINE's
  local DEADLINE=$DEADLINE budget=$(( $(date +%s) + ${PER_PROCESS_LIMIT:-420} ))
  [ "$budget" -lt "$DEADLINE" ] && DEADLINE=$budget
  local tag="${GPU_TAG}x$NGPU" date run mpi n b
  date=$(date -u +%F)
  local test=tests/gpu/test_per_process_gpu.py
  if [ -f "$test" ]; then
    for run in "ompi 1" "ompi 2" "impi 2"; do
      read -r mpi n <<<"$run"
      step "per-process-tests-$mpi-$n" 75 0 "export MPIGPU_TIMEOUT=60; ${LAUNCH[$mpi]} -n $n $PY -m pytest -v -rfE --color=no --with-mpi --only-mpi $test -p no:cacheprovider"
    done
  else
    printf '%-4s %-38s (no %s in this checkout)\n' FAIL per-process-tests "$test" | tee -a "$SUMMARY"
    failures=$((failures + 1))
  fi
  # issue 38: mpigpu.jax's FFI call once per GPU inside shard_map, one process driving both GPUs
  step "per-process-jax-tests-ompi-1" 75 0 "export MPIGPU_TIMEOUT=60; $OMPI -n 1 $PY -m pytest -v -rfE --color=no --with-mpi --only-mpi tests/gpu/test_jax_per_device_gpu.py -p no:cacheprovider"
  for b in auto nccl host; do
    step "per-process-average-1x2-$b" 45 0 "$OMPI -n 1 $PY -m mpigpu.average --devices-per-rank 2 --backend $b --size 16M --json $LOGS/per-process-average-1x2-$b.json"
  done
  step "per-process-average-2x1-auto" 45 0 "$OMPI -n 2 $PY -m mpigpu.average --devices-per-rank 1 --backend auto --size 16M --json $LOGS/per-process-average-2x1-auto.json"
  step "per-process-bench-1x2" 90 0 "$OMPI -n 1 $PY scripts/per_process_bench.py --json $OUT/per-process-1x2-$tag-$date.json"
  step "per-process-bench-2x1" 90 0 "$OMPI -n 2 $PY scripts/per_process_bench.py --json $OUT/per-process-2x1-$tag-$date.json"
  step "per-process-bench-merge" 20 0 "$PY scripts/per_process_bench.py --merge $OUT/per-process-1x2-$tag-$date.json $OUT/per-process-2x1-$tag-$date.json --out $OUT/gpus-per-process-$tag-$date.txt"
  if [ "${JAX_STEP:-1}" = 1 ]; then
    step "per-process-jax-step" 90 0 "$OMPI -n 1 $PY scripts/jax_step_bench.py --local-devices --json $OUT/jax-step-local-$tag-$date.json"
  else
    printf '%-4s %-38s (JAX_STEP=0)\n' SKIP per-process-jax-step | tee -a "$SUMMARY"
  fi
}

stage_average() {
  local b
  for b in auto nccl host ipc; do
    step "average-ompi-$b" 120 0 "$OMPI -n $NGPU $PY -m mpigpu.average --backend $b --size 16M --json $LOGS/average-ompi-$b.json"
  done
  step "average-ompi-8B-auto" 120 0 "$OMPI -n $NGPU $PY -m mpigpu.average --size 2 --iters 200 --warmup 20"
  for b in cuda-aware host nccl; do
    step "average-impi-$b" 120 0 "$IMPI -n $NGPU $PY -m mpigpu.average --backend $b --size 16M --json $LOGS/average-impi-$b.json"
  done
  step "average-ompi-forced-cuda-aware" 120 fail "ulimit -c unlimited; MPIGPU_CUDA_AWARE=1 $OMPI -n 2 $PY -m mpigpu.average --backend cuda-aware --size 1M"
}

stage_shared() {
  for mpi in ompi impi; do
    step "shared-$mpi-2" 400 0 "export MPIGPU_ALLOW_SHARED_GPU=1; ${LAUNCH[$mpi]} -n 2 $PY -m pytest -v -rfE --color=no --with-mpi --only-mpi tests/gpu/test_host_gpu.py tests/gpu/test_gpu_paths.py tests/gpu/test_training_gpu.py tests/gpu/test_torch_dist_gpu.py -p no:cacheprovider"
  done
  # issue 47's one-GPU sanity run: DDP over the torch.distributed backend, two ranks on the one GPU, against gloo
  step "shared-ddp-sample" 120 0 "MPIGPU_ALLOW_SHARED_GPU=1 $OMPI -n 2 $PY samples/ddp_mpigpu.py --device cuda --static-graph --fp16-hook"
  step "shared-average-host-16M" 120 0 "MPIGPU_ALLOW_SHARED_GPU=1 $OMPI -n 2 $PY -m mpigpu.average --backend host --size 16M"
  step "shared-average-host-8B" 120 0 "MPIGPU_ALLOW_SHARED_GPU=1 $OMPI -n 2 $PY -m mpigpu.average --backend host --size 2 --iters 500"
}

stage_serial() {
  # these tests start 2 ranks: on a one-GPU machine they share it
  local share=""
  [ "$NGPU" -lt 2 ] && share="export MPIGPU_ALLOW_SHARED_GPU=1; "
  step serial-gpu 180 0 "$share$PY -m pytest -v -rfE --color=no tests/gpu/test_bad_input_gpu.py tests/gpu/test_kernel_cache_gpu.py tests/test_samples.py -p no:cacheprovider"
}

stage_sanitize() {
  step sanitize-ipc 240 0 "OUT=$LOGS/sanitize NP=2 scripts/sanitize-ipc.sh"
}

stage_bench() {
  local tag="${GPU_TAG}x$NGPU"
  local date
  date=$(date -u +%F)
  step "bench-ompi" 300 0 "MPIGPU_TUNE_FILE=$OUT/tune.json $OMPI -n $NGPU $PY -m mpigpu.bench --placement gpu --inplace --time-limit 6 --autotune --json $OUT/$tag-ompi-$date.json --plot $OUT/$tag-ompi-$date.png"
  step "ipc-latency" 75 0 "$OMPI -n $NGPU $PY scripts/ipc_latency.py --json $LOGS/ipc-latency.json"
}

stage_bench_impi() {
  local tag="${GPU_TAG}x$NGPU"
  step "bench-impi" 150 0 "$IMPI -n $NGPU $PY -m mpigpu.bench --placement gpu --backends cuda-aware --inplace -b 16M --time-limit 6 --json $OUT/$tag-impi-$(date -u +%F).json"
}

stage_usercall() {
  local tag="${GPU_TAG}x$NGPU" date tune="$OUT/tune-usercall.json"
  date=$(date -u +%F)
  # auto follows the table the bench stage just measured, else this machine's committed one (a copy: the
  # benchmark writes nothing without --tune, and the header says whether the table applies)
  if [ -f "$OUT/tune.json" ]; then cp "$OUT/tune.json" "$tune"
  elif [ -f "bench/results/tune-$tag-ompi.json" ]; then cp "bench/results/tune-$tag-ompi.json" "$tune"; fi
  step "usercall-ompi" 150 0 "MPIGPU_TUNE_FILE=$tune $OMPI -n $NGPU $PY -m mpigpu.bench --placement gpu --inplace --dtypes float32 --ops sum --sizes 8,64K,1M,4M,16M,256M,1G --backends auto,nccl,ipc,nccl-raw,torch-nccl --calls user,persistent --framework torch --time-limit 10 --json $OUT/$tag-usercall-ompi-$date.json --plot $OUT/$tag-usercall-ompi-$date.png"
  step "call-cost-torch" 60 0 "MPIGPU_TUNE_FILE=$tune $OMPI -n $NGPU $PY scripts/call_cost.py --framework torch --sizes 8,65536 --json $OUT/call-cost-torch-$tag-$date.json"
}

stage_collectives() {  # issues 16 and 36: the five collectives in ONE job (one stream, one NCCL communicator and
  # one torch process group for all), each beside raw NCCL and torch.distributed's own call on tensors made once,
  # the calls as a torch user writes them; each collective's paths interleaved round by round at each size
  local tag="${GPU_TAG}x$NGPU" date tune="$OUT/tune-collectives.json" dir="$OUT/collectives" small
  date=$(date -u +%F)
  small=$((4 * NGPU)); [ "$small" -lt 8 ] && small=8  # a float32 row per rank: 8 B on 2 GPUs
  # auto follows the table the bench stage measured, else this machine's committed one (as in usercall)
  if [ -f "$OUT/tune.json" ]; then cp "$OUT/tune.json" "$tune"
  elif [ -f "bench/results/tune-$tag-ompi.json" ]; then cp "bench/results/tune-$tag-ompi.json" "$tune"; fi
  step "collectives-ompi" "${COLLECTIVES_LIMIT:-300}" 0 "MPIGPU_TUNE_FILE=$tune $OMPI -n $NGPU $PY -m mpigpu.bench --collective all --placement gpu --inplace --dtypes float32 --sizes $small,4K,64K,1M,16M,256M --backends auto,nccl,host,cuda-aware,ipc,nccl-raw,torch-nccl --calls user,persistent,out --framework torch --rounds 7 --time-limit ${COLL_TIME:-4} --tag $tag --json-dir $dir --plot $dir/$tag-collectives-$date.png"
  # the table of all five comes back beside the summary (everything else is packed in results.tgz)
  cp "$dir/$tag-collectives-$date.md" "$OUT/" 2>/dev/null || true
  # the Horovod layer's per-call row on CUDA tensors beside mpigpu.allreduce(t) and allreduce_async(t).wait()
  step "hvd-call-ompi" "${HVD_CALL_LIMIT:-90}" 0 "$OMPI -n $NGPU $PY scripts/hvd_call_bench.py --device gpu --sizes 8,64K,1M --json $dir/hvd-call-$tag-$date.json"
}

stage_soak() {
  step soak-ompi 150 0 "$OMPI -n $NGPU $PY -m mpigpu.bench.soak --calls ${SOAK_CALLS:-3000} --json $LOGS/soak-ompi.json"
  soak_rss soak-ompi
  step check-cost 60 0 "$OMPI -n $NGPU $PY -m mpigpu.bench.soak --check-cost --device gpu --iters 5000"
}

soak_rss() {  # rank 0's RSS lines of a soak (after warm-up, each variant first met later, the end) into the summary
  grep -a '^# rss ' "$LOGS/$1.log" | cut -c1-200 | sed 's/^/       /' >>"$SUMMARY"
}

stage_soak_repeat() {  # issue 46 (not in the default list: name it): the soak's memory, one soak after another
  # first with only the largest calls as warm-up and empty kernel caches (CuPy's and mpigpu's), so each kernel is
  # compiled (NVRTC) at the variant that first needs it: its RSS lines show what each first-met variant costs (a
  # diagnostic: its memory bound is lifted, its elements are still checked);
  # then SOAK_RUNS (default 10) soaks as gpu-check runs them (every variant in the warm-up), seed SOAK_SEED
  local seed=${SOAK_SEED:-1147368330} calls=${SOAK_CALLS:-3000} i cold
  cold=$(mktemp -d "${TMPDIR:-/tmp}/mpigpu-soak-cold.XXXXXX") || { echo "mktemp -d failed"; return; }
  step soak-largest-cold 60 0 "MPIGPU_CACHE_DIR=$cold/mpigpu CUPY_CACHE_DIR=$cold/cupy $OMPI -n $NGPU $PY -m mpigpu.bench.soak --calls $calls --seed $seed --warm-up largest --mem-slack 100000 --quiet"
  soak_rss soak-largest-cold
  rm -rf "$cold"
  for i in $(seq 1 "${SOAK_RUNS:-10}"); do
    step "soak-$i" 60 0 "$OMPI -n $NGPU $PY -m mpigpu.bench.soak --calls $calls --seed $seed --quiet"
    soak_rss "soak-$i"
  done
}

stage_train() {
  step train-ompi 240 0 "OUT=$OUT/training TRAIN_DEADLINE=225 scripts/training-figures.sh"
  stage_timeline
}

stage_timeline() {  # part of train; alone: the two timelines again
  # issue 37: the timelines of ResNet-50 and GPT-2 with BackwardAverager on every GPU: complete (every rank,
  # every bucket's marks, a backward span per step), merged with its report (who waited, how much of the
  # reduction backward hid), and one step drawn
  local model tl
  for model in resnet50 gpt2; do
    tl="$OUT/timeline-$model"
    step "timeline-$model-ompi" 100 0 "rm -rf $tl && MPIGPU_TIMELINE=$tl $OMPI -n $NGPU $PY scripts/timeline_step.py --model $model --steps 6 && $PY -m mpigpu.timeline check $tl && $PY -m mpigpu.timeline merge $tl -o $OUT/timeline-$model-trace.json && $PY -m mpigpu.timeline plot $tl -o $OUT/timeline-$model-${GPU_TAG}x$NGPU.png --title '$model, BackwardAverager, $NGPU x $GPU_TAG: one step'"
  done
}

stage_jax() {  # issue 23: JAX bound to each rank's GPU under Open MPI (every rank sees every GPU), the sample
  # under both MPIs, then the step bench: in-jit (FFI), shard_map + mj.average_tree (XLA's), pmean, leave jit
  local k="init_binds or another_gpu or average_tree or step_sample or mismatch or compiled_handler or back_to_back"
  step "jax-bind-ompi" 100 0 "export MPIGPU_TIMEOUT=60; $OMPI -n $NGPU $PY -m pytest -v -rfE --color=no --with-mpi --only-mpi tests/gpu/test_jax_gpu.py -k '$k' -p no:cacheprovider"
  step "jax-bind-started-ompi" 100 0 "export MPIGPU_TIMEOUT=60 MPIGPU_TEST_JAX_STARTED=1; $OMPI -n $NGPU $PY -m pytest -v -rfE --color=no --with-mpi --only-mpi tests/gpu/test_jax_gpu.py -k '$k' -p no:cacheprovider"
  for mpi in ompi impi; do
    step "jax-sample-$mpi" 75 0 "${LAUNCH[$mpi]} -n $NGPU $PY samples/jax_step.py"
  done
  if [ "${JAX_STEP:-1}" = 1 ]; then  # issue 38: the step bench under both MPIs
    step "jax-step-ompi" 170 0 "$OMPI -n $NGPU $PY scripts/jax_step_bench.py --json $OUT/jax-step-${GPU_TAG}x$NGPU-$(date -u +%F).json"
    # Intel MPI with I_MPI_OFFLOAD=1 shows each rank one GPU of its own: one rank per GPU, at most 2
    local n=2
    [ "$NGPU" -lt 2 ] && n=1
    step "jax-step-impi" 170 0 "$IMPI -n $n $PY scripts/jax_step_bench.py --json $OUT/jax-step-${GPU_TAG}x$n-impi-$(date -u +%F).json"
  fi
}

# Horovod's test_torch.py as one session: PASS when it ends (no stall) with no failure but those outside
# mpigpu (docs/horovod.md: Adasum's test_delta_optimizer; torch's Muon in the three optimizer tests)
HVD_OUT_OF_SCOPE='test_delta_optimizer|test_broadcast_state|test_broadcast_state_options|test_force_allreduce'
# at one rank (one GPU), two more cannot hold under Horovod itself (docs/horovod.md): test_horovod_join_allreduce
# asserts join() returns a rank other than the first to join, and with one rank both are 0;
# test_horovod_sync_batch_norm's reference, torch's BatchNorm1d on the whole batch, refuses one value per channel
[ "$NGPU" -lt 2 ] && HVD_OUT_OF_SCOPE="$HVD_OUT_OF_SCOPE|test_horovod_join_allreduce|test_horovod_sync_batch_norm"
hvd_session() {  # hvd_session LAUNCH OUTFILE
  local out=$2 unexpected
  # no -W ignore: Horovod's test_synchronize_step_warning records a warning with the filters it inherits
  (cd .hvd-suite && PYTHONPATH=$PWD:$PYTHONPATH MPIGPU_TIMEOUT=90 $1 -n "$NGPU" "$PY" -m pytest -c pytest.ini \
    --rootdir . -v -rfE --color=no -p no:cacheprovider test/parallel/test_torch.py) >"$out" 2>&1
  cat "$out"
  unexpected=$(grep -aoE '^FAILED [^ ]+::[^ ]+' "$out" | sed 's/.*:://' | sort -u | grep -vxE "$HVD_OUT_OF_SCOPE")
  echo "failures outside the known out-of-scope ones: ${unexpected:-none}"
  [ -z "$unexpected" ] && grep -aqE '[0-9]+ passed' "$out"
}
export -f hvd_session
export HVD_OUT_OF_SCOPE NGPU PY

stage_hvd() {  # Horovod's own PyTorch tests, one session per MPI, every GPU (docs/horovod.md)
  if [ ! -f .hvd-suite/test/parallel/test_torch.py ]; then
    printf '%-4s %-38s (no .hvd-suite: scripts/hvd-suite.sh HOROVOD_CHECKOUT, and carry it)\n' FAIL hvd | tee -a "$SUMMARY"
    failures=$((failures + 1))
    return
  fi
  # Open MPI only: Horovod's tests place CUDA tensors on GPU hvd.local_rank(), which assumes every rank sees
  # every GPU; Intel MPI with I_MPI_OFFLOAD=1 shows each rank one (on 2 x H100 rank 1's .cuda(1) failed and
  # the ranks fell apart)
  step hvd-ompi "${HVD_LIMIT:-240}" 0 "hvd_session '$OMPI' $LOGS/hvd-ompi.pytest.txt"
}

stage_hvd_synth() {  # issue 37: Horovod's synthetic benchmark on mpigpu's layer beside DDP, the runs alternated
  if [ ! -f .hvd-suite/examples/pytorch/pytorch_synthetic_benchmark.py ]; then
    printf '%-4s %-38s (no .hvd-suite benchmark: scripts/hvd-suite.sh HOROVOD_CHECKOUT, and carry it)\n' FAIL hvd_synth \
      | tee -a "$SUMMARY"
    failures=$((failures + 1))
    return
  fi
  if [ "$NGPU" -lt 2 ]; then
    printf '%-4s %-38s (needs 2 GPUs, this machine has %s)\n' SKIP hvd_synth "$NGPU" | tee -a "$SUMMARY"
    return
  fi
  step hvd-synth-ompi "${HVD_SYNTH_LIMIT:-150}" 0 "$PY scripts/hvd_synthetic.py --launcher '$OMPI' -n 2 --runs 2 \
    --model resnet50 --batch-size 32 --num-warmup-batches 5 --num-batches-per-iter 10 --num-iters 5 --timeout 70 \
    --json $OUT/hvd-synthetic-${GPU_TAG}x2-$(date -u +%F).json"
}

stage_retest() {  # RETEST="pytest paths" under Open MPI with all GPUs and Intel MPI with 2 (1 on a one-GPU machine)
  local n=2
  [ "$NGPU" -lt 2 ] && n=1
  step "retest-ompi-$NGPU" "${RETEST_LIMIT:-120}" 0 "export MPIGPU_TIMEOUT=120; $OMPI -n $NGPU $PY -m pytest -v -rfE --color=no --with-mpi --only-mpi --durations=12 ${RETEST:-tests/gpu} -p no:cacheprovider"
  step "retest-impi-$n" "${RETEST_LIMIT:-120}" 0 "export MPIGPU_TIMEOUT=120; $IMPI -n $n $PY -m pytest -v -rfE --color=no --with-mpi --only-mpi --durations=12 ${RETEST:-tests/gpu} -p no:cacheprovider"
}

# issue 48 goal 6: nodes that MPI sees (MPICH's fork launcher, named hosts), each its own NCCL host
nodes_info_check() {  # nodes_info_check LOG: the info step's verdict (2 nodes, ipc refused, auto never ipc)
  local log=$1 bad=0
  grep -aqE 'ranks on 2 nodes' "$log" || { echo "nodes: FAIL: mpigpu.info does not report 2 nodes"; bad=1; }
  grep -aqE '^  ipc +unavailable: the ranks span 2 nodes' "$log" || { echo "nodes: FAIL: ipc is not refused for spanning nodes"; bad=1; }
  grep -aqE -- '-> ipc ' "$log" && { echo "nodes: FAIL: auto picks ipc across nodes"; bad=1; }
  [ "$bad" = 0 ] && echo "nodes: 2 nodes, ipc unavailable, auto never ipc: PASS"
  return "$bad"
}
nodes_transport_check() {  # nodes_transport_check LOG: NCCL connected the nodes through NET only
  local log=$1
  grep -aoE 'via (NET|P2P|SHM)/[A-Za-z]+' "$log" | sort | uniq -c
  if grep -aqE 'via NET/' "$log" && ! grep -aqE 'via (P2P|SHM)/' "$log"; then
    echo "nodes: NCCL between the nodes through its network transport: PASS"
  else
    echo "nodes: FAIL: NCCL did not connect the nodes through NET alone"
    return 1
  fi
}
export -f nodes_info_check nodes_transport_check

stage_nodes() {
  if [ "$NGPU" -lt 2 ]; then
    printf '%-4s %-38s (needs 2 GPUs, this machine has %s)\n' SKIP nodes "$NGPU" | tee -a "$SUMMARY"
    return
  fi
  local whl base dir per tag date one two
  whl=$(ls .gpu-carry/mpich/mpich-*.whl 2>/dev/null | head -n 1)
  if [ -z "$whl" ] || ! base=$(mktemp -d "${TMPDIR:-/tmp}/mpigpu-mpich.XXXXXX") || ! $PY -m zipfile -e "$whl" "$base"; then
    printf '%-4s %-38s (no MPICH wheel in .gpu-carry/mpich, or it did not unpack)\n' FAIL nodes | tee -a "$SUMMARY"
    failures=$((failures + 1))
    return
  fi
  dir=$(echo "$base"/mpich-*.data/data)  # the wheel's bin/ and lib/, made executable (zip keeps no modes)
  chmod +x "$dir"/bin/*
  local DEADLINE=$DEADLINE budget=$(( $(date +%s) + ${NODES_LIMIT:-420} ))
  [ "$budget" -lt "$DEADLINE" ] && DEADLINE=$budget
  per=$((NGPU / 2)) tag="${GPU_TAG}x$NGPU" date=$(date -u +%F)
  one="env PATH=$dir/bin:\$PATH MPI4PY_LIBMPI=$dir/lib/libmpi.so.12 mpiexec -launcher fork"
  two="$one -hosts nodeA:$per,nodeB:$per -n $((2 * per)) scripts/node-rank.sh"
  one="$one -hosts nodeA:$((2 * per)) -n $((2 * per)) scripts/node-rank.sh"
  step nodes-info 60 0 "$two $PY -m mpigpu.info >$LOGS/nodes-info.txt 2>&1; rc=\$?; cat $LOGS/nodes-info.txt; [ \$rc = 0 ] && nodes_info_check $LOGS/nodes-info.txt"
  step nodes-nccl-net 60 0 "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET $two $PY -m mpigpu.average --backend nccl --size 1M >$LOGS/nodes-nccl.txt 2>&1; rc=\$?; cat $LOGS/nodes-nccl.txt; [ \$rc = 0 ] && nodes_transport_check $LOGS/nodes-nccl.txt"
  step nodes-tests 150 0 "export MPIGPU_TIMEOUT=60; $two $PY -m pytest -v -rfE --color=no --with-mpi --only-mpi tests/gpu/test_nodes_gpu.py tests/gpu/test_collectives_gpu.py -p no:cacheprovider"
  for b in auto nccl host; do
    step "nodes-average-$b" 45 0 "$two $PY -m mpigpu.average --backend $b --size 16M --json $LOGS/nodes-average-$b.json"
  done
  step nodes-average-8B-auto 45 0 "$two $PY -m mpigpu.average --size 2 --iters 200 --warmup 20"
  local bench="$PY -m mpigpu.bench --placement gpu --inplace --dtypes float32 --ops sum --sizes 8,64K,1M,4M,16M,256M --backends auto,nccl,host,nccl-raw --time-limit ${NODES_TIME:-3}"
  step nodes-bench-2nodes 90 0 "$two $bench --json $OUT/nodes-2nodes-$tag-$date.json"
  step nodes-bench-1node 90 0 "$one $bench --json $OUT/nodes-1node-$tag-$date.json"
  rm -rf "$base"
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env info tests per_process average serial sanitize bench usercall bench_impi soak train)
for s in "${stages[@]}"; do
  if declare -F "stage_$s" >/dev/null; then "stage_$s"; else echo "unknown stage $s" | tee -a "$SUMMARY"; failures=$((failures + 1)); fi
done

# the summary as a result file to commit (bench/results/gpu-check-<gpu>x<n>-<date>.txt): what ran where, then the steps
RESULT="$OUT/gpu-check-${GPU_TAG}x$NGPU-$(date -u +%F).txt"
{
  echo "# gpu-check on $NGPU x $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1), $(date -u +%FT%TZ)"
  echo "# stages: ${stages[*]}; tree: $(git rev-parse --short HEAD 2>/dev/null || echo 'not a git checkout'); source: $($PY scripts/source_digest.py 2>/dev/null || echo unknown) (scripts/source_digest.py --find gives its commits)"
  echo "# $(mpirun --version 2>/dev/null | head -n 1); $($PY - 2>/dev/null <<'PY'
from importlib import metadata

found = []
for name in ("numpy", "mpi4py", "torch", "cupy-cuda13x", "jax"):
    try:
        found.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        pass
print(", ".join(found))
PY
)"
  echo "# failed steps: $failures"
  cat "$SUMMARY"
} >"$RESULT"
tar czf "$OUT/logs.tgz" -C "$OUT" logs 2>/dev/null && rm -rf "$LOGS"
# at most a few files come back from a lease: everything but the summary and the logs in one archive
(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name summary.txt ! -name logs.tgz ! -name results.tgz \
  ! -name '*-collectives-*.md' ! -name 'gpu-check-*.txt' -print0 \
  | tar czf results.tgz --null -T - --remove-files) 2>/dev/null
echo "===== gpu-check summary ($NGPU GPUs, $(date -u +%FT%TZ)) ====="
cat "$SUMMARY"
echo "failed steps: $failures"
[ "$failures" -eq 0 ]
