#!/usr/bin/env bash
# The next H200 session's runs, in stages that each fit one 600 s device call:
#   bash bench/h200_session.sh STAGE   (after the .whl install line of bench/gpu_tests.sh)
# Every step has its own time limit and writes JSON / logs under $OUT as it goes, so a
# cut step loses only itself. Merge afterwards: `python -m bench.merge --run N F...`.
set -u
out=${OUT:-.}
step() {  # step SECONDS NAME COMMAND...: run, log to $OUT/NAME.log, print the timing lines
  local limit=$1 name=$2
  shift 2
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "== $name (exit $?)"
  grep -E " ms(/step.*)?$|passed|failed" "$out/$name.log" | tail -40
}
suite() {  # suite SECONDS NAME ARGS...: one bench.run call into $OUT/NAME.json
  local limit=$1 name=$2
  shift 2
  step "$limit" "$name" python3 -m bench.run --out "$out/$name.json" "$@"
}
case "${1:?stage 1 or 2}" in
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
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
