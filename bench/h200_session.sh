#!/usr/bin/env bash
# The next H200 session's runs, in stages that each fit one 600 s device call:
#   bash bench/h200_session.sh STAGE   (after the .whl install line of bench/gpu_tests.sh)
# Every step has its own time limit and writes JSON under $OUT as it goes, so a cut step
# loses only itself. At most 8 files come back from $OUT (run 17 lost two): the steps'
# logs share one, $OUT/session.log, and the GPU tests write three.
# Merge afterwards: `python -m bench.merge --run N F...`.
set -u
out=${OUT:-.}
step() {  # step SECONDS NAME COMMAND...: run, append to $OUT/session.log, print timings
  local limit=$1 name=$2 log=/tmp/step.log
  shift 2
  timeout "$limit" "$@" > "$log" 2>&1
  local status=$?
  { echo "===== $name (exit $status)"; cat "$log"; } >> "$out/session.log"
  echo "== $name (exit $status)"
  grep -E " ms(/step.*)?$|passed|failed" "$log" | tail -40
}
suite() {  # suite SECONDS NAME ARGS...: one bench.run call into $OUT/NAME.json
  local limit=$1 name=$2
  shift 2
  step "$limit" "$name" python3 -m bench.run --out "$out/$name.json" "$@"
}
case "${1:?stage 1, 2 or 3}" in
  1)
    # GPU tests that run 16 did not reach (cuDNN, Triton, SSM, MoE dispatch).
    step 300 gpu_tests bash bench/gpu_tests.sh -k "not mosaic_matches and not \
mosaic_pingpong and not mosaic_fp16 and not grouped_matmul and not expert_parallel and not \
ring_attention and not split_kv and not cudnn_padded"
    suite 110 set_transformer --suite set_transformer
    suite 60 kv_lengths --suite kv_lengths --set fraction=0.25 --only "probjax triton" \
      "probjax mosaic"
    suite 100 attention_fp32 --suite attention --seq 1024 4096 --set head_dim=64,128 \
      dtype=float32 causal=false --only "probjax auto" "probjax triton" "probjax xla"
    ;;
  2)
    suite 250 sequence --suite sequence --seq 1024 4096
    suite 200 moe --suite moe --seq 131072 1048576
    suite 120 dit --suite dit
    ;;
  3)
    # Run 17's leftovers: the cuDNN agreement test with its rounding-aware bound, RLA at
    # T=4096 under the bench's relative tolerance, the Mosaic grouped matmul's kernels
    # one by one, head_dim 256, T=16384 and the set-transformer rows whose JSON was lost.
    step 75 gpu_tests env OUT=/tmp/tests bash -c 'mkdir -p $OUT; bash bench/gpu_tests.sh \
      -k "triton_agrees_with_cudnn or vmap_over_moe"; cat $OUT/gpu_tests_by_name.txt; \
      cat $OUT/failures.txt 2>/dev/null; tail -3 $OUT/gpu_tests.txt'
    suite 50 rla4096 --suite sequence --seq 4096 --only "rla scan" "rla triton"
    step 100 sweep_gmm python3 -m bench.sweep_gmm --out "$out/sweep_gmm.json" --impl mosaic
    suite 70 attention_hd256 --suite attention --seq 4096 --set head_dim=256 --only \
      "probjax auto" "probjax triton" "probjax mosaic" "probjax cudnn" "torch sdpa cudnn" \
      "torch sdpa flash" "jax.nn cudnn"
    suite 150 sequence16k --suite sequence --seq 16384
    suite 75 set_transformer --suite set_transformer --seq 1024 --only "probjax auto" \
      "probjax triton" "probjax cudnn" "tokamax triton" "torch sdpa cudnn" "torch flex"
    ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
