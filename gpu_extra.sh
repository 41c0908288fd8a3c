# session 5 extras (untracked): calibrated prefill, then decode and serving without CUDA graphs
CFG=$(python3 -c "import json; d=json.loads(open('scripts/data/h200_s5_fit_llama8b.json').read().strip().splitlines()[-1]); print(json.dumps({'memory_coefficients': d['coefficients']}))")
timeout 100 python3 scripts/bench_prefill_memory.py --model llama-8b --dtype bfloat16 --lengths 8192,6144,4096,2048 --skip-naive \
  --ways sequential,engine --warmup full --peak-tflops 790 --engine-config "$CFG" --json --out $OUT/prefill_calibrated.json >>$OUT/log.txt 2>&1
echo "calibrated rc=$?" >>$OUT/log.txt
MLX_USE_CUDA_GRAPHS=0 timeout 80 python3 scripts/bench_decode_step.py --models llama-8b --dtype bfloat16 --prompt-tokens 512 --batches 1,4,8 \
  --warmup 5 --steps 20 --async-decode 1 --paged-attention 1 --fuse-projections 1 --out $OUT/decode_nographs.json >>$OUT/log.txt 2>&1
echo "decode nographs rc=$?" >>$OUT/log.txt
MLX_USE_CUDA_GRAPHS=0 timeout 130 python3 scripts/bench_serving.py --engine-only --model llama-8b --dtype bfloat16 --concurrency 4,8 \
  --backends engine_sync,mlx_lm --repeat 2 --prompt-tokens 512 --output-tokens 128 --json --out $OUT/serving_nographs.json >>$OUT/log.txt 2>&1
echo "serving nographs rc=$?" >>$OUT/log.txt
