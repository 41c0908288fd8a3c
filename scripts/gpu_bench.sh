#!/usr/bin/env bash
# The whole GPU benchmark in one command (docs/benchmarks.md, "H200"): installs MLX CUDA from carried
# wheels, then runs, each in its own process under a deadline, writing JSON under $OUT:
#   prefill.json   scripts/bench_prefill_memory.py  8B, 8192/6144/4096/2048 (sequential, engine, mlx_lm)
#   prefill_only.json  the same, sequential and engine, prompts stopping at their first token (PREFILL_ONLY=1)
#   serving.json   scripts/bench_serving.py --engine-only  4 and 8 x 512-token prompts, 128 new tokens
#   greedy.json    scripts/check_greedy.py  the engine's greedy tokens vs mlx-lm's (default reads and all gathers)
#   grid.json      scripts/bench_memory_grid.py  per-chunk / per-decode transients for CUDA coefficients
#   naive.json     naive_padded alone, last (it may exhaust the card: MLX then aborts the process)
#   tight.json     scripts/bench_tight_burst.py  (TIGHT=1) a burst of random lengths a few GB above the weights
#   log.txt, env.txt
# BENCH_CONC (4,8) the serving streams, BENCH_LENGTHS (8192,6144,4096,2048) the prefill prompts;
# SERVING_BACKENDS (engine_sync,engine,mlx_lm): the variants of serving.json (scripts/bench_serving.py --backends);
# SERVING_REPEAT (2) timed passes, SERVING_CAP (200) the serving step's seconds.
# SKIP_CHECK / SKIP_GRID / SKIP_PREFILL / SKIP_SERVING / SKIP_NAIVE=1 leave a step out; FIT=1 fits
# the memory model's CUDA coefficients to the grid (FIT_ARGS: bench_memory_grid.py's fit options, default
# the benchmark model alone) and runs the prefill benchmark with them; MLX_* variables pass
# through (the engine's memory model assumes EngineConfig.execution.max_ops_per_buffer: 8 on CUDA).
#
# Wheels: /root/stash/part_aa (carried by earlier calls) + wheels_b/ (part_ab and the small wheels). Every
# call also carries the tracked tree (~24 MB), so with a 64 MiB carry the MLX CUDA wheel goes in three
# parts of 30 MB (split -b 30000000), calls within the machine's 30 s of warmth:
#   call 1: carry wheels_a (its first part, p1): mkdir -p /root/stash && cp wheels_a/p1 /root/stash/
#   call 2: carry gpu_wheels (p2): cat /root/stash/p1 gpu_wheels/p2 > /root/stash/part_aa
#   call 3: carry wheels_b (the last part as part_ab): bash scripts/gpu_bench.sh
# On a CPU (to test this script): SKIP_INSTALL=1 BENCH_MODEL=llama-test BENCH_DTYPE=float32 \
#   BENCH_SMALL=1 OUT=/tmp/gpu_out bash scripts/gpu_bench.sh
set -u
OUT=${OUT:-/tmp/gpu_bench_out}
mkdir -p "$OUT"
START=$(date +%s)
BUDGET_S=${BUDGET_S:-560}        # the device's per-command limit is 600 s
MODEL=${BENCH_MODEL:-llama-8b}
DTYPE=${BENCH_DTYPE:-bfloat16}
LOG="$OUT/log.txt"
log() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# Run one step with a timeout of min(cap, time left - reserve); its output goes to the log.
step() {
  local name=$1 cap=$2 reserve=$3; shift 3
  local t=$(( $(left) - reserve )); (( t > cap )) && t=$cap
  if (( t < 20 )); then log "SKIP $name: ${t}s left"; return 0; fi
  log "START $name (timeout ${t}s): $*"
  timeout --signal=TERM --kill-after=5 "$t" "$@" >>"$LOG" 2>&1
  log "END $name rc=$?"
}

{
  echo "date: $(date -u)"; uname -a; nproc; free -g 2>/dev/null | head -2
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1
  which python3; python3 -V
} >"$OUT/env.txt" 2>&1

if [[ -z "${SKIP_INSTALL:-}" ]]; then
  if [[ -d /root/site/mlx ]]; then  # installed by an earlier call on this (still warm) machine
    log "MLX already in /root/site"
  else
    WHL=/tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
    cat /root/stash/part_aa wheels_b/part_ab >"$WHL"
    sed "s#  mlx_cuda#  /tmp/mlx_cuda#" wheels_b/mlx_cuda_13.sha256 | sha256sum -c - >>"$LOG" 2>&1 \
      || log "WARNING: joined wheel checksum mismatch"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site "$WHL" wheels_b/*.whl >>"$LOG" 2>&1
    log "pip install rc=$?"
  fi
  # libmlx.so finds the CUDA libraries through RPATH $ORIGIN/../../nvidia/...: point that at the
  # image's own nvidia-* packages (cublas, cudnn, nccl, nvrtc, cufft, cusolver).
  NV=$(python3 -c "import nvidia, os; print([p for p in nvidia.__path__ if not p.startswith('/root/site')][0])" 2>>"$LOG")
  [[ -n "$NV" && ! -e /root/site/nvidia ]] && ln -s "$NV" /root/site/nvidia
  export PYTHONPATH=/root/site:$PWD
  export LD_LIBRARY_PATH="$(ls -d "$NV"/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}"
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
# A snapshot of engine/ taken when this script was rehearsed (carried, git-ignored) wins over the
# working tree, which other people may be editing while the call is sent.
if [[ -d .bench_snapshot/engine ]]; then
  export PYTHONPATH=$PWD/.bench_snapshot:$PYTHONPATH
  echo "engine snapshot of $(cat .bench_snapshot/ENGINE_COMMIT 2>/dev/null)" >>"$OUT/env.txt"
fi
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=/root/mlx_ptx_cache TOKENIZERS_PARALLELISM=false
mkdir -p "$MLX_PTX_CACHE_DIR" 2>/dev/null || export MLX_PTX_CACHE_DIR=/tmp/mlx_ptx_cache
python3 - >>"$OUT/env.txt" 2>&1 <<'EOF'
import mlx.core as mx, mlx_lm, importlib.metadata as md
print("mlx", mx.__version__, "mlx_lm", md.version("mlx-lm"), "device", mx.default_device())
print("device_info", mx.device_info() if hasattr(mx, "device_info") else None)
a = mx.random.normal((1024, 1024), dtype=mx.bfloat16); mx.eval(a @ a)
import engine.engine, engine.core.memory.model
print("engine from", engine.engine.__file__)
print("engine imports ok")
EOF
log "import check rc=$? ($(tail -1 "$OUT/env.txt"))"

if [[ -n "${BENCH_SMALL:-}" ]]; then  # CPU rehearsal sizes
  LENGTHS=1024,768,512,256; CONC=2,4; PT=64; NT=8; CHECK_LENGTHS=30,70,150,210
  GRID=(--chunks 128,256 --prefill-length 1024 --decode-rows 4,1 --decode-contexts 256,1024)
else
  LENGTHS=${BENCH_LENGTHS:-8192,6144,4096,2048}; CONC=${BENCH_CONC:-4,8}; PT=512; NT=128
  CHECK_LENGTHS=${CHECK_LENGTHS:-300,700,1500,2100}
  GRID=(--chunks 128,256,512,1024,2048 --prefill-length 8192 --decode-rows 16,8,4,2,1 --decode-contexts 1024,4096,8192)
fi
COMMON=(--model "$MODEL" --dtype "$DTYPE")

[[ -n "${SKIP_CHECK:-}" ]] || step check 120 200 python3 scripts/check_greedy.py "${COMMON[@]}" --lengths $CHECK_LENGTHS \
  --out "$OUT/greedy.json"
# The grid first: with FIT=1 its fit (scripts/bench_memory_grid.py --fit) gives the coefficients the
# prefill benchmark's engine then uses (EngineConfig.memory_coefficients), under this run's MLX settings.
[[ -n "${SKIP_GRID:-}" ]] || step grid 220 60 python3 scripts/bench_memory_grid.py "${COMMON[@]}" --variants "${GRID[@]}" --repeat 2 \
  --json --out "$OUT/grid.json"
PREFILL_CONFIG=()
if [[ -n "${FIT:-}" && -s "$OUT/grid.json" ]]; then
  # FIT_ARGS: by default a calibration for the benchmark's model alone (its chunk sizes' largest points;
  # no context-dependent prefill terms: cuDNN attention never materializes the scores)
  python3 scripts/bench_memory_grid.py --fit "$OUT/grid.json" --backend cuda \
    ${FIT_ARGS:---fit-variants $MODEL --exclude-terms prefill_scores,prefill_mask --chunk-maxima} --json >"$OUT/fit.json" 2>>"$LOG"
  CONFIG=$(python3 -c "import json,sys; print(json.dumps({'memory_coefficients': json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])['coefficients']}))" "$OUT/fit.json" 2>>"$LOG")
  log "fit: $CONFIG"
  [[ -n "$CONFIG" ]] && PREFILL_CONFIG=(--engine-config "$CONFIG")
fi
[[ -n "${SKIP_PREFILL:-}" ]] || step prefill 240 200 python3 scripts/bench_prefill_memory.py "${COMMON[@]}" --lengths $LENGTHS --skip-naive \
  --warmup full --peak-tflops 790 "${PREFILL_CONFIG[@]}" --json --out "$OUT/prefill.json"
# The engine's prompts stop at their first token (--max-tokens 1): prefill alone, as the sequential way
# (with the default 32, prompts that finished decode while the others still prefill).
[[ -z "${PREFILL_ONLY:-}" ]] || step prefill_only 120 160 python3 scripts/bench_prefill_memory.py "${COMMON[@]}" --lengths $LENGTHS \
  --ways sequential,engine --max-tokens 1 --warmup full --peak-tflops 790 --json --out "$OUT/prefill_only.json"
[[ -n "${SKIP_SERVING:-}" ]] || step serving ${SERVING_CAP:-200} 120 python3 scripts/bench_serving.py --engine-only "${COMMON[@]}" --concurrency $CONC \
  --backends ${SERVING_BACKENDS:-engine_sync,engine,mlx_lm} --repeat ${SERVING_REPEAT:-2} --prompt-tokens $PT --output-tokens $NT --json \
  --out "$OUT/serving.json"
[[ -n "${SKIP_NAIVE:-}" ]] || step naive 120 0 python3 scripts/bench_prefill_memory.py "${COMMON[@]}" --lengths $LENGTHS --ways naive_padded \
  --peak-tflops 790 --json --out "$OUT/naive.json"
# TIGHT=1: scripts/bench_tight_burst.py, a burst of 40 random requests (50-8000 prompt tokens, 8-200 new)
# under limits TIGHT_GB (3,6,12) GB above the weights, each with max_num_batched_tokens TIGHT_BUDGETS
# (default the engine's), TIGHT_WAYS (engine; add mlx_lm for its BatchGenerator on the same burst)
[[ -z "${TIGHT:-}" ]] || step tight ${TIGHT_CAP:-400} 0 python3 scripts/bench_tight_burst.py "${COMMON[@]}" \
  --headroom-gb ${TIGHT_GB:-3,6,12} --budgets "${TIGHT_BUDGETS:-}" --max-num-seqs 64 --max-model-len 8448 \
  --ways ${TIGHT_WAYS:-engine} --json --out "$OUT/tight.json"
# EXTRA_CMD: one more command (e.g. a variant of a benchmark), run last with the same environment
[[ -z "${EXTRA_CMD:-}" ]] || step extra "${EXTRA_CAP:-200}" 0 bash -c "$EXTRA_CMD"
env | grep '^MLX_' >>"$OUT/env.txt"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >>"$OUT/env.txt" 2>&1
log "done; files: $(ls "$OUT" | tr '\n' ' ')"
