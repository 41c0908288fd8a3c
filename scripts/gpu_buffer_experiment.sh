#!/usr/bin/env bash
# Follow-up to scripts/gpu_bench.sh on the H200 (docs/benchmarks.md, "Why the CUDA transient is
# larger"): MLX's CUDA backend frees a kernel's temporaries only when the batch of ops it was committed
# in has run, so the transient depends on how many ops are batched. Re-run the 8B prefill (sequential
# and engine ways) and the 8-stream decode under MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER settings.
# Needs the wheels as gpu_bench.sh (call 1 stashes part A; this is call 2, carrying wheels_b).
set -u
OUT=${OUT:-/tmp/gpu_exp_out}; mkdir -p "$OUT"; LOG="$OUT/log.txt"; START=$(date +%s)
log() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
if [[ -z "${SKIP_INSTALL:-}" ]]; then
  WHL=/tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  cat /root/stash/part_aa wheels_b/part_ab >"$WHL"
  python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site "$WHL" wheels_b/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=/root/site:$PWD
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
[[ -d .bench_snapshot/engine ]] && export PYTHONPATH=$PWD/.bench_snapshot:$PYTHONPATH
export PYTHONUNBUFFERED=1 MLX_PTX_CACHE_DIR=/tmp/mlx_ptx_cache
MODEL=${BENCH_MODEL:-llama-8b}; DTYPE=${BENCH_DTYPE:-bfloat16}
LENGTHS=${BENCH_LENGTHS:-8192,6144,4096,2048}; PT=${BENCH_PT:-512}; NT=${BENCH_NT:-64}
for setting in default ops8 ops2mb16; do
  case $setting in
    default) ENVS=() ;;
    ops8) ENVS=(MLX_MAX_OPS_PER_BUFFER=8) ;;
    ops2mb16) ENVS=(MLX_MAX_OPS_PER_BUFFER=2 MLX_MAX_MB_PER_BUFFER=16) ;;
  esac
  log "START prefill $setting ${ENVS[*]:-}"
  env "${ENVS[@]}" timeout 120 python3 scripts/bench_prefill_memory.py --model $MODEL --dtype $DTYPE \
    --lengths $LENGTHS --ways sequential,engine --warmup full --peak-tflops 790 --json \
    --out "$OUT/prefill_$setting.json" >>"$LOG" 2>&1
  log "END prefill $setting rc=$?"
  log "START serving $setting"
  env "${ENVS[@]}" timeout 90 python3 scripts/bench_serving.py --engine-only --model $MODEL --dtype $DTYPE \
    --concurrency 8 --backends engine_sync,mlx_lm --prompt-tokens $PT --output-tokens $NT --json \
    --out "$OUT/serving_$setting.json" >>"$LOG" 2>&1
  log "END serving $setting rc=$?"
done
log "done: $(ls "$OUT" | tr '\n' ' ')"
