#!/usr/bin/env bash
# The next H200 session's runs, in stages that each fit one 600 s device call:
#   bash bench/h200_session.sh STAGE   (after the .whl install line of bench/gpu_tests.sh)
# Every step has its own time limit and writes JSON under $OUT as it goes, so a cut step
# loses only itself. At most 8 files come back from $OUT (run 17 lost two): the steps'
# logs, the GPU tests' included, share one, $OUT/session.log.
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
    # GPU tests of session 10's changes (cuDNN at head_dim 256; the MoE and grouped
    # matmul now move rows by gathers both ways), then the grouped matmul at 131k and 1M
    # rows and the MoE dispatches at 16k and 131k tokens (run 17: Mosaic 18.7 ms fwd+bwd
    # at 1M rows, of which its kernels took 2.5; 131k rows last ran in run 9).
    step 150 gpu_tests env OUT=/tmp/tests bash -c 'mkdir -p $OUT; bash bench/gpu_tests.sh \
      -k "cudnn_head_dim_256 or grouped_matmul or moe or cudnn_matches"; \
      cat $OUT/gpu_tests_by_name.txt; cat $OUT/failures.txt 2>/dev/null; tail -3 $OUT/gpu_tests.txt'
    suite 120 moe16k --suite moe --seq 16384 --only "grouped_matmul triton" \
      "grouped_matmul mosaic" "grouped_matmul xla" "grouped_matmul ragged_dot" \
      "grouped_matmul dense balanced" "probjax moe auto" "probjax moe mosaic" \
      "probjax moe triton"
    suite 280 moe --suite moe --seq 131072 --only "grouped_matmul triton" \
      "grouped_matmul mosaic" "grouped_matmul xla" "grouped_matmul tokamax" \
      "probjax moe auto" "probjax moe mosaic" "probjax moe triton"
    ;;
  2)
    # head_dim 256 on cuDNN (auto), the MoE at 1M tokens, and the sequence rows that run
    # 18's T=16384 call did not reach.
    suite 80 attention_hd256 --suite attention --seq 4096 --set head_dim=256 --only \
      "probjax auto" "probjax cudnn" "probjax triton" "torch sdpa cudnn" "jax.nn cudnn"
    suite 250 moe1m --suite moe --seq 1048576 --only "grouped_matmul mosaic" \
      "probjax moe auto" "probjax moe mosaic"
    suite 180 sequence16k --suite sequence --seq 16384 --only "rla chunked" "rla triton" \
      "mla auto" "mha auto" "mamba2 triton"
    ;;
  3)
    # RLA's linear branch: warps and the chunk-parallel backward (new in session 10; the
    # single-kernel backward is ~6 ms of RLA's 7.7 ms fwd+bwd at T=4096), GPU SSM tests.
    step 170 sweep_ssm python3 -m bench.sweep_ssm --out "$out/sweep_ssm.json" \
      --kernel chunked_linear
    step 90 sweep_gmm python3 -m bench.sweep_gmm --out "$out/sweep_gmm.json" --impl mosaic
    step 120 gpu_tests env OUT=/tmp/tests bash -c 'mkdir -p $OUT; bash bench/gpu_tests.sh \
      -k "selective_scan or ssd or linear_branch or chunk_parallel"; \
      cat $OUT/gpu_tests_by_name.txt; cat $OUT/failures.txt 2>/dev/null; tail -3 $OUT/gpu_tests.txt'
    # float32 attention rows run 17 did not reach (T=4096 at head_dim 128).
    suite 90 attention_fp32 --suite attention --seq 4096 --set head_dim=128 dtype=float32 \
      causal=false --only "probjax auto" "probjax triton" "probjax xla" "torch sdpa efficient"
    ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
