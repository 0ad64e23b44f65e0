#!/usr/bin/env bash
# The next H200 session's runs, in stages that each fit one 600 s device call:
#   bash bench/h200_session.sh STAGE   (after the .whl install line of bench/gpu_tests.sh)
# Every step has its own time limit and writes JSON under $OUT as it goes, so a cut step
# loses only itself. At most 8 files come back from $OUT (run 17 lost two): the steps'
# logs, the GPU tests' included, share one, $OUT/session.log.
# Merge afterwards: `python -m bench.merge --run N F...`. Since run 152 `time_fn` samples
# 100 ms, not 20: a step of many timings takes up to 5x its earlier time.
# Not yet run: 79 (now with torch SDPA's flash beside it: the
# H100's flash rows date from 20 ms samples too); 80 and 83 on an H200 (its decode rows
# date from 20 ms samples); 88 on an H200 (the join was timed on the H100 alone); 12's
# parts that runs 44-47 did not reach.
# Runs 58-63 (H100) ran 21, 22, 14, 1, 24 and the forward half of 13; runs 64-70 ran
# 25, 26, 27, 23, 28, 11 and 15; run 71 ran 29; runs 74-76 ran 30, 31 and 15; runs 83-85
# ran 32, 1 and 23; runs 87-90 ran 36 (with dq_rows), 34 (with dq_rows), half of 36
# and half of 37; runs 91-92 (one call) ran 37; runs 93-98 ran 38-43 (41 only its
# non-causal half: both steps reached their limits compiling the causal 8-call stacks);
# run 99 ran 44 but its decode step, cut at its limit before a row; runs 100-105 ran
# 45-50, run 106 (an H200) 51; run 107 (H200) swept the split-KV tiles and fill;
# runs 108-112 ran 52-56; run 113 reran 56's GPU tests, their expectation mended;
# runs 114-115 ran 57 (its GQA hd 64 shape at MHA 4096 keys instead); run 116 ran 58;
# run 117 ran 61 (its one-stage route crashed the GPU, mended since), run 118 its other
# shapes without that route; run 119 ran 62 and 63, run 120 64;
# run 121 ran 1, cut at 92 of 111 tests (since split into 1 and 65); runs 122-126 ran
# 68 with 69, 67, 1, 65 and 23 (run 127: 69's probe at the ISAB shape; run 128: the
# vmapped rows before the fold, on the code of 7dbb495); run 129 ran 66; runs 130-132
# (outside the stages) tested and fingerprinted the custom_jvp autodiff; runs 133-136
# (an H200) ran 59, 60, 11 and 15; run 137 (H100) ran 70, runs 138-139 (H100) 71 and
# 73, run 140 73's GPU tests; runs 141-144 (an H200) ran 72, 74, 1 and 23; runs 145-146
# (H100) ran 75 and 65, runs 147-149 (H100) 76, 77 and 78, runs 150-152 probes outside
# the stages (command buffers off; CUPTI kernel times; sample length); runs 153-154 (H100)
# ran 79 (153 at up to 1000 calls a sample, not merged), run 155 attention at T 4096;
# runs 156-158 (H100) ran 81, 80 and 82, run 159 swept 82's configs further, run 160 ran
# 83, run 161 the decode suite's train rows at batch 4 and 16 and over 32768 keys; run
# 162 (H100) 85, cut at its tests' limit; runs 163-165 (H100) 85, 86 and 87, run 166 Mosaic
# at T 16384 causal hd 128 (suite row and backward configs), run 167 84's first sweep; run
# 168 (H100) 88, run 169 the join's rows at T 32768 and 84; run 170 (H100) 39 of stage 1's 83
# tests in 290 s (none failed), all this session's device time allowed; runs 171-172 (H100,
# one machine) 65 of them (none failed), 18 not reached; runs 173-174 (H100, one machine,
# on 51d8c6c) 89 (those 18) and 65: all passed.
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
gpu_tests() {  # gpu_tests SECONDS PYTEST_ARGS...: GPU tests, their pass list and failures
  local limit=$1
  shift
  step $((limit + 10)) gpu_tests env OUT=/tmp/tests WORKERS="${WORKERS:-8}" LIMIT="$limit" \
    bash -c 'mkdir -p $OUT; bash bench/gpu_tests.sh "$@"; cat $OUT/gpu_tests_by_name.txt; \
      cat $OUT/failures.txt 2>/dev/null; tail -3 $OUT/gpu_tests.txt' _ "$@"
}
suite() {  # suite SECONDS NAME ARGS...: one bench.run call into $OUT/NAME.json
  local limit=$1 name=$2
  shift 2
  step "$limit" "$name" python3 -m bench.run --out "$out/$name.json" "$@"
}
sweep_mosaic_bwd() {  # the backward configs at T 4096 (run 16: fwd+bwd 2.82 ms at 128/128)
  step 330 sweep_mosaic_bwd python3 -m bench.sweep_attention \
    --out "$out/sweep_mosaic_bwd.json" --implementation mosaic --seq 4096 \
    --head-dim 128 --causal 0 1 --part bwd
}
# The Triton backward on set-transformer shapes (64 sets x 4 heads, 1024 queries):
# sweep_set_bwd SECONDS NAME KEYS HEAD_DIMS CONFIGS...
sweep_set_bwd() {
  local limit=$1 name=$2 keys=$3 dims=$4
  shift 4
  step "$limit" "$name" python3 -m bench.sweep_attention --out "$out/$name.json" \
    --implementation triton --seq 1024 --kv-seq "$keys" --batch 64 --heads 4 \
    --head-dim $dims --causal 0 --part bwd --config "$@"
}
# Gradient-checked rows: T 4096 / 16384 (hd 64/128, causal and not), our default beside
# both cuDNN routes, then decode's training rows: gradient_rows LONG_SECONDS DECODE_SECONDS
gradient_rows() {
  suite "$1" grads_long --suite attention --seq 4096 16384 --set head_dim=64,128 \
    dtype=bfloat16 --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
  suite "$2" grads_decode --suite decode --set q_len=128 kv_len=8192 ragged=false \
    --only "probjax auto" "torch sdpa flash" "torch sdpa cudnn"
}
fused='"backward_pass_impl": "triton_fused"'
one_key_tile=("{\"block_k_dkv\": 128, $fused}" "{\"block_k_dkv\": 128, \"num_warps_bwd\": 8, $fused}")
attention_causal_16k() {  # our default at T 16384 hd 64 causal beside both cuDNN routes
  suite 200 attention_causal_16k --suite attention --seq 16384 \
    --set causal=True dtype=bfloat16 head_dim=64 \
    --only "probjax auto" "probjax mosaic" "jax.nn cudnn" "torch sdpa cudnn"
}
# Training over a KV cache's shape, batch 8 MHA, 128 queries over 8192 keys (stage 81 on):
# our default beside both cuDNN routes, into $OUT/decode_train.json. 100 s.
mha_train_row() {
  suite 100 decode_train --suite decode --set batch=8 heads=32:32 q_len=128 \
    kv_len=8192 ragged=false --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
}
passed_in() {  # passed_in LOG...: a --deselect=ID for each test the logs list as PASSED
  sed -n 's/^PASSED \([^ ]*\).*/--deselect=\1/p' "$@" | sort -u
}
case "${1:?stage 1 to 89}" in
  1 | 23 | 65)
    # The whole GPU test suite in three calls: attention's tests but the Mosaic schedules
    # (1), those (65), and the rest (23). Run 121 reached 92 of attention's 111 tests in
    # 540 s.
    files=tests/test_gpu_attention.py select="not schedules_and_two_warpgroup"
    [ "$1" = 65 ] && select="schedules_and_two_warpgroup"
    [ "$1" = 23 ] && files="tests/test_gpu_moe.py tests/test_gpu_parallel.py tests/test_gpu_ssm.py" \
      select=""
    step 560 gpu_tests env OUT=/tmp/tests WORKERS=8 FILES="$files" SELECT="$select" \
      bash -c 'mkdir -p $OUT; LIMIT=540 bash bench/gpu_tests.sh --durations=15 -k "$SELECT"; \
      cat $OUT/gpu_tests_by_name.txt; cat $OUT/failures.txt 2>/dev/null; tail -25 $OUT/gpu_tests.txt'
    ;;
  2)
    # Where the MoE layer's 7.3 ms forward at 131k tokens goes (run 19), then every
    # dispatch at 131k in one run (run 19 cut Mosaic), the shared expert now bfloat16.
    step 200 profile_moe python3 -m bench.profile_moe --out "$out/profile_moe.json" \
      --tokens 131072 --dispatch fused_gsum triton mosaic
    suite 200 moe --suite moe --seq 131072 --only "probjax moe mosaic" "probjax moe auto"
    # Mamba-2's SSD: does the chunk-parallel backward pay for narrow states too?
    step 120 sweep_ssm python3 -m bench.sweep_ssm --out "$out/sweep_ssm.json" --kernel ssd
    # Our default's cuDNN route at 1.03x torch cuDNN's time: what it runs beside the kernel.
    step 40 attention_work python3 -m bench.attention_work auto jax.nn-cudnn
    ;;
  3)
    # 1M tokens (8M rows), whose compile the constant-folded layout had cut in run 20;
    # RLA at T=4096 on its new default (64-step chunks, chunk-parallel backward). Left for
    # later: float32 attention peers at T 4096 (auto measured in run 21: 3.29 / 18.0 ms).
    suite 300 moe1m --suite moe --seq 1048576 --only "grouped_matmul mosaic" \
      "grouped_matmul triton" "probjax moe auto" "probjax moe mosaic"
    suite 110 sequence --suite sequence --seq 4096 --only "rla triton" "rla chunked" \
      "mla auto" "mha auto"
    # What runs around the decode kernel at Lq 1 (0.93-0.99x torch cuDNN, the kernel
    # itself at the copy rate): the compiled programs' launches.
    step 60 decode_hlo python3 -m bench.profile_decode --hlo auto/8/131072/8 \
      auto/1/131072/32 cudnn/8/131072/8
    # head_dim 256: auto runs cuDNN since run 20; its peers last ran against the Triton
    # default (the report's 0.42x gap compares within that older run).
    suite 80 attention_hd256 --suite attention --seq 4096 --set head_dim=256 causal=false \
      --only "probjax auto" "torch sdpa cudnn" "jax.nn cudnn" "torch sdpa flash"
    ;;
  4)
    # Run 27: MoE auto's Mosaic forward outside differentiation (inference_dispatch), the
    # float32 hd 256 backward's 16-row steps (378 ms fwd+bwd in run 25), and their tests.
    step 190 gpu_tests env OUT=/tmp/tests WORKERS=8 bash -c 'mkdir -p $OUT; \
      bash bench/gpu_tests.sh -k "auto_forward_is_mosaic or vmap_over_moe or \
      large_head_dims_and_fp32 or moe_dispatch_matches"; cat $OUT/gpu_tests_by_name.txt; \
      cat $OUT/failures.txt 2>/dev/null; tail -3 $OUT/gpu_tests.txt'
    suite 100 moe --suite moe --seq 16384 131072 --only "probjax moe auto"
    suite 80 attention_fp32 --suite attention --seq 4096 --set head_dim=256 causal=false \
      --only "probjax auto"
    step 200 sweep_fp32 python3 -m bench.sweep_attention --out "$out/sweep_fp32.json" \
      --seq 4096 --head-dim 256 128 --dtype float32 --part bwd --causal 0
    ;;
  5)
    # Decode reading the caller's q / k / v (no pad, pack, slice or unpack launches; the
    # ranges of unmasked calls as constants) on 128-key steps, one program per SM: its
    # GPU tests, the Lq 1 / 16 rows beside torch cuDNN, and the compiled launches.
    step 220 gpu_tests env OUT=/tmp/tests WORKERS=8 bash -c 'mkdir -p $OUT; \
      bash bench/gpu_tests.sh -k "split_kv_decode or triton or ring or cudnn_padded"; \
      cat $OUT/gpu_tests_by_name.txt; cat $OUT/failures.txt 2>/dev/null; \
      tail -3 $OUT/gpu_tests.txt'
    step 40 decode_hlo python3 -m bench.profile_decode --hlo auto/8/131072/8 \
      auto/1/131072/32 auto/1/131072/8
    suite 280 decode --suite decode --set q_len=1,16 --only "probjax auto" \
      "probjax triton" "jax.nn cudnn" "torch sdpa cudnn" "torch sdpa flash"
    ;;
  6)
    # Run 32: the merge of split partials as one parallel block per program (run 31's
    # merged 64-row tiles in 8 programs looping over up to 128 splits), splits capped by
    # their partials' traffic, one batch element's lengths planned as no lengths. Tests
    # first (run 31's were cut before their log was written: pytest's own limit now).
    step 250 gpu_tests env OUT=/tmp/tests WORKERS=8 bash -c 'mkdir -p $OUT; \
      LIMIT=235 bash bench/gpu_tests.sh -k "split_kv_decode or triton or ring"; \
      grep -E "PASSED|FAILED|ERROR" $OUT/gpu_tests.txt | sed "s/^.*::/::/" | sort | uniq -c; \
      cat $OUT/failures.txt 2>/dev/null | head -80; tail -3 $OUT/gpu_tests.txt'
    step 90 ncu env NCU_LIMIT=75 bash bench/ncu.sh "$out" decode bench.profile_decode \
      auto/1/32768/8:q16 torch-flash/1/32768/8:q16 \
      auto/1/32768/8:q16:ragged auto/8/131072/32 torch-cudnn/8/131072/32
    suite 200 decode --suite decode --set q_len=1,16 --only "probjax auto" "jax.nn cudnn" \
      "torch sdpa cudnn" "torch sdpa flash"
    ;;
  7)
    # Run 33: the decode gaps at 8k keys, batch 1 (0.73-0.87x torch cuDNN, run 32): tiles
    # x splits there; T=1024 training beside its peers (the report's oldest gaps, run 1);
    # then where the 1M-token MoE's time goes (Mosaic's train step 0.93x fused_gsum).
    step 150 sweep_decode python3 -m bench.sweep_decode --out "$out/sweep_decode.json" \
      --shape 1,8192,8 1,8192,32 1,32768,8 --programs 32 64 132 264
    suite 150 attention1k --suite attention --seq 1024 --set head_dim=64,128 \
      --only "probjax auto" "torch sdpa flash" "torch sdpa cudnn" "jax.nn cudnn"
    step 200 profile_moe python3 -m bench.profile_moe --out "$out/profile_moe.json" \
      --tokens 1048576 --dispatch fused_gsum mosaic
    ;;
  8)
    # Run 35: the Mosaic MoE's second matmul and combine under one VJP
    # (padded_matmul_combine: no [rows, d_model] products kept or re-read for the router
    # weights' gradient; run 34 put 24 ms of the 1M-token layer's backward outside its
    # matmuls). Its GPU tests, then the profile and the suite at 1M tokens: 67.96 ms.
    WORKERS=4 gpu_tests 110 -k "moe_dispatch_matches or auto_forward_is_mosaic"
    step 120 profile_moe python3 -m bench.profile_moe --out "$out/profile_moe.json" \
      --tokens 1048576 --dispatch mosaic fused_gsum --repeats 10
    suite 300 moe1m --suite moe --seq 1048576 --only "probjax moe auto" "probjax moe mosaic"
    ;;
  9)
    # Run 36. Decode without range arrays (run 31 still had two broadcast launches at batch 8).
    step 40 decode_hlo python3 -m bench.profile_decode --hlo auto/8/131072/8
    # MLA beside MHA at every T in one run (#7: T 1024 1.22x in run 18; 16384 cross-run).
    suite 150 sequence_mla --suite sequence --only "mla auto" "mha auto"
    ;;
  10)
    # Run 43 (its tests were cut at 76% with no failure logged): session 14's changes:
    # the sorted dispatch's second matmul and combine under one VJP (matmul_combine), and the tokens' top-k copies gathered
    # again in the backward instead of kept (matmul_of_copies: every sorted / Mosaic
    # mode). Their GPU tests, then auto (Mosaic), triton and xla beside run 42's train
    # steps (131k: 9.40 / 12.82 / 13.95 ms; 1M: 67.35 / 99.96 / 103.6) and plan GiB.
    # With them session 15's default-on Mosaic attention backward (S and dP issued
    # together, GQA's heads summed in the dK/dV program): both sets of tests in one call.
    gpu_tests 310 -k "test_gpu_moe or (mosaic and test_gpu_attention)"
    suite 200 moe_sorted --suite moe --seq 131072 1048576 \
      --only "probjax moe triton" "probjax moe xla" "probjax moe auto"
    # Which cuDNN each framework loads (torch SDPA cuDNN is 2-7% ahead of JAX's cuDNN
    # attention on the same memory: #5 / #9's known gaps).
    step 30 cudnn_versions python3 -c 'import torch; print("torch cudnn", \
      torch.backends.cudnn.version()); from jax._src.lib import cuda_versions as c; \
      print("jax cudnn", c.cudnn_get_version())'
    ;;
  11)
    # Not yet run: every sequence mixer at every T in one run with today's defaults
    # (#7's table mixes runs 17-41: the Mamba-2 and RLA defaults changed since run 17).
    suite 500 sequence --suite sequence
    ;;
  12)
    # Run 44 ran this step's first half (tests cut at 46%, the forward sweep's first nine
    # configs at T 4096 non-causal) beside stage 13's backward sweep (non-causal): P in
    # registers and transposed views became the GPU's default. Session 15's changes: the Mosaic attention backward issuing S and dP together
    # (and dV's product beside dS^T) and summing GQA's query heads inside the dK/dV
    # program (one program per KV head), the forward's intra-warpgroup overlap
    # (overlap_softmax), FA3's register mode (p_in_registers: P / dS from registers, the
    # output accumulated in place) and transposed SMEM views (transposed_views), all off
    # until timed. Their GPU tests (the register operands run only there), then the forward
    # configs at T 4096 and 16384 (#5's goal: 550 TFLOP/s at 16384, hd 128; run 16:
    # 0.602 ms at 4096, the default 0.617 in the suite).
    WORKERS=4 gpu_tests 210 -k "mosaic and test_gpu_attention"
    step 330 sweep_mosaic_4k python3 -m bench.sweep_attention \
      --out "$out/sweep_mosaic_4k.json" --implementation mosaic --seq 4096 --head-dim 128 \
      --causal 0 1 --part fwd
    ;;
  13)
    # The forward configs at T 16384 (#5: 550 TFLOP/s, hd 128 non-causal; run 63: 6.83 ms
    # at best, 644 TFLOP/s), then the backward configs at T 4096 (stage 26 runs those).
    step 230 sweep_mosaic_16k python3 -m bench.sweep_attention \
      --out "$out/sweep_mosaic_16k.json" --implementation mosaic --seq 16384 \
      --head-dim 128 --causal 0 --part fwd
    sweep_mosaic_bwd
    ;;
  14)
    # Fwd+bwd of Mosaic's default (FA3's forward schedule since run 47) beside tokamax
    # Mosaic and torch cuDNN in one run (run 45: 2.40 / 2.09 / 1.84 ms; fwd 0.569 /
    # 0.459 / 0.458).
    suite 300 attention_mosaic --suite attention --seq 4096 16384 --set head_dim=128 \
      --only "probjax mosaic" "tokamax mosaic" "torch sdpa cudnn" "probjax auto"
    # SoftCap (Gemma's 30) inside Mosaic against Triton, each at its default config: the
    # score_mod regime puts Triton first until this says otherwise.
    for impl in mosaic triton; do
      step 120 "softcap_$impl" python3 -m bench.sweep_attention \
        --out "$out/softcap_$impl.json" --implementation $impl --defaults --softcap 30 \
        --seq 4096 --head-dim 128 --causal 0 1
    done
    ;;
  15)
    # The set-transformer shapes (hd 32) with every peer in one run: the report's rows
    # mix runs 12 and 18 (tokamax Triton and torch flash 0.93x our time at 128 x 1024).
    suite 400 set_transformer --suite set_transformer
    ;;
  17)
    # Run 47 made FA3's forward schedule the GPU default (0.530 ms against 0.571, T 4096
    # hd 128 fwd) and cut both its GPU-test calls: the segment-id cases of the FA3
    # schedules (64-key dK/dV with register operands and views) started in both and
    # finished in neither (a hang, or slow compiles?); the rest passed. Those cases alone
    # with room, then each kernel's counters beside tokamax Mosaic's and cuDNN's (run 45,
    # fwd+bwd 2.40 / 2.09 / 1.84 ms; fwd 0.569 / 0.459 / 0.458), then the new default's
    # forward at T 16384 (run 46: 8.967 ms, 490 TFLOP/s; #5's goal 550).
    WORKERS=4 gpu_tests 200 -k "segments and fa3"
    step 150 ncu env NCU_LIMIT=130 bash bench/ncu.sh "$out" attention bench.attention_work \
      --launch 1 mosaic tokamax-mosaic jax.nn-cudnn
    step 200 sweep_mosaic_16k python3 -m bench.sweep_attention \
      --out "$out/sweep_mosaic_16k.json" --implementation mosaic --seq 16384 \
      --head-dim 128 --causal 0 --part fwd
    ;;
  18)
    # The shared expert's gate | up in one matmul through `swiglu`, the router's logits
    # cast again in the backward and its top-k keeping the indices alone (session 16:
    # the layer's jaxpr residuals 25 -> 19 -> 17 -> 14.5 GiB at 1M tokens; the top-k's
    # values now a pass of their own): XLA's plan (temp GiB) and time
    # beside run 43's auto (3.54 / 28.41 GiB; 9.92 / 70.19 ms at 131k / 1M) and run 42's
    # fused_gsum (1.82 / 14.37 GiB; 91.48 ms at 1M).
    suite 280 moe --suite moe --seq 131072 1048576 \
      --only "probjax moe auto" "probjax moe fused_gsum" "probjax moe xla"
    ;;
  19)
    # Session 18's `fused_dq` (FA3's backward: dQ's products in the dK/dV program, added
    # by TMA reductions; 5 products a step instead of 7 over two kernels). Its GPU tests
    # (the CPU ran it interpreted and lowered it), then its backward beside the default's
    # (run 45: fwd+bwd 2.401 ms at T 4096 hd 128 non-causal; tokamax Mosaic 2.089, torch
    # SDPA cuDNN 1.836).
    WORKERS=4 gpu_tests 200 -k "fused_dq or fa3_backward or approx or (schedules and fa3 and not fa3_)"
    step 360 sweep_fused_dq python3 -m bench.sweep_attention \
      --out "$out/sweep_fused_dq.json" --implementation mosaic --seq 4096 16384 \
      --head-dim 128 64 --causal 0 1 --part bwd --config '{}' '{"fused_dq": true}'
    ;;
  20)
    # The compiler's approximate exp2 (`approx_math`, as tokamax compiles; its exactness
    # is stage 19's `approx` GPU tests): forward and backward, beside the default.
    step 560 sweep_approx_math python3 -m bench.sweep_attention \
      --out "$out/sweep_approx_math.json" --implementation mosaic --seq 4096 16384 \
      --head-dim 128 --causal 0 1 --config '{}' '{"approx_math": true}'
    ;;
  21)
    # `launch_group` 1 and 3 (the order remapped in the kernel) under FA3's schedule,
    # then SoftCap's GPU test alone: it has never finished (runs 48, 53, 56); pytest's
    # faulthandler prints every thread's stack after 100 s (compiling, or a kernel that
    # never returns).
    WORKERS=4 gpu_tests 200 -k "launch_group"
    step 260 softcap env PROBJAX_FAILURE_LOG="$out/softcap_failures.txt" python3 -m pytest \
      --gpu -p no:benchmark -v -o faulthandler_timeout=100 -x \
      "tests/test_gpu_attention.py::test_mosaic_softcap_on_gpu[default]"
    ;;
  22)
    # Launch groups under causal masks (H100 run 53: None beat 1 at T 4096, 1.23 against
    # 1.28 ms fwd+bwd at hd 128; lost at T 16384, 17.2 against 16.6): groups of 4 and 16
    # pairs keep some of each.
    step 500 sweep_launch_group python3 -m bench.sweep_attention \
      --out "$out/sweep_launch_group.json" --implementation mosaic --seq 4096 16384 \
      --head-dim 128 64 --causal 1 --config '{"launch_group": null}' \
      '{"launch_group": 1}' '{"launch_group": 4}' '{"launch_group": 16}'
    # The forward without ping-pong (the overlap alone) in the new order: run 54, T 16384
    # hd 128, 6.83 ms against 7.02 with it.
    step 250 sweep_pingpong python3 -m bench.sweep_attention \
      --out "$out/sweep_pingpong.json" --implementation mosaic --seq 4096 16384 \
      --head-dim 128 64 --causal 0 --part fwd --config '{}' '{"pingpong": false}'
    ;;
  24)
    # The MoE layer at 1M tokens alone in its process: on the H100 (run 55, after the
    # 131k rows) auto's 28.41 GiB and xla's 31.75 GiB plans hit OOM, though the card
    # holds 80; JAX's allocator keeps at most 75% and the earlier rows' regions.
    step 300 moe_1m env XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 python3 -m bench.run \
      --out "$out/moe_1m.json" --suite moe --seq 1048576 \
      --only "probjax moe auto" "probjax moe fused_gsum" "probjax moe xla"
    ;;
  25)
    # The defaults changed after runs 59-60 (causal launch groups of 4, no ping-pong for
    # non-causal hd 64 / T 16384, SoftCap routed to Mosaic) under their GPU tests, with
    # those run 61 cut: SoftCap's FA3 schedules, fused_dq under vmap, fp16, cuDNN's
    # padded repeats and the segment / KV-length schedules.
    step 560 gpu_tests env OUT=/tmp/tests WORKERS=8 FILES=tests/test_gpu_attention.py \
      bash -c 'mkdir -p $OUT; LIMIT=540 bash bench/gpu_tests.sh --durations=15 -k \
        "mosaic_matches_oracle or softcap or auto or fused_dq_under_vmap or fp16_unaligned \
        or padded_backward_repeats or (schedules and (segments or kv_lengths))"; \
        cat $OUT/gpu_tests_by_name.txt; cat $OUT/failures.txt 2>/dev/null; \
        tail -25 $OUT/gpu_tests.txt'
    ;;
  26)
    # Ping-pong under causal masks in their launch order (run 59 timed it only without
    # masks: off won at hd 64 and T 16384), then the backward configs.
    step 250 sweep_pingpong_causal python3 -m bench.sweep_attention \
      --out "$out/sweep_pingpong_causal.json" --implementation mosaic --seq 4096 16384 \
      --head-dim 128 64 --causal 1 --part fwd --config '{}' '{"pingpong": false}'
    sweep_mosaic_bwd
    ;;
  27)
    # Where the backward's time goes around its kernel, ours beside JAX's cuDNN route
    # (run 60, T 4096 hd 128: fwd+bwd 2.07 ms Mosaic, 2.00 JAX cuDNN, 1.88 torch cuDNN,
    # whose kernels are the same): XLA's fusions too (dQ^T's zeros and transpose, the
    # row sums of dO * O), one launch of each program.
    step 200 ncu env NCU_LIMIT=180 NCU_KERNELS='regex:mosaic_gpu|fusion|cudnn|fmha|sdpa' \
      bash bench/ncu.sh "$out" attention_fusions bench.attention_work --launch 1 mosaic \
      jax.nn-cudnn
    ;;
  28)
    # Decoding on the H100 (no rows yet: runs 31-32 were the H200's), Lq 1 / 16 over 32k
    # and 131k keys beside JAX's and torch's cuDNN and torch's flash.
    suite 400 decode --suite decode --seq 32768 131072 --set q_len=1,16 \
      --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn" "torch sdpa flash"
    ;;
  29)
    # The set-transformer's q 128 over 4096 keys at hd 32 (run 70: our Triton fwd+bwd
    # 0.617 ms, torch cuDNN 0.435): dK/dV stored in bf16 when no GQA group sums them,
    # and the dQ kernel's keys split over programs, beside torch cuDNN and our cuDNN.
    step 100 sweep_dq_splits python3 -m bench.sweep_attention \
      --out "$out/sweep_dq_splits.json" --implementation triton --seq 128 --kv-seq 4096 \
      --batch 64 --heads 4 --head-dim 32 --causal 0 --part bwd --config '{}' \
      '{"num_splits_dq": 2}' '{"num_splits_dq": 4}' '{"num_splits_dq": 8}'
    suite 100 set_transformer --suite set_transformer --set elements=4096 \
      --only "probjax auto" "probjax triton" "probjax cudnn" "torch sdpa cudnn"
    ;;
  30)
    # The Triton backward's split dQ (runs 71-73) and the Mosaic forward's ping-pong off
    # at hd 64 / T 16384 under causal masks (run 65) under their GPU tests.
    step 250 gpu_tests env OUT=/tmp/tests WORKERS=8 FILES=tests/test_gpu_attention.py \
      bash -c 'mkdir -p $OUT; LIMIT=230 bash bench/gpu_tests.sh --durations=10 -k \
        "triton or (mosaic_matches_oracle and causal) or higher_derivatives"; \
        cat $OUT/gpu_tests_by_name.txt; \
        cat $OUT/failures.txt 2>/dev/null; tail -25 $OUT/gpu_tests.txt'
    # Run 65's causal backward at T 4096 hd 128: 1.197 ms with the TMA warpgroup's 40
    # registers, 1.162 with 24 (non-causal 2.065 / 2.077): twice more, hd 64 too.
    for pass in 1 2; do
      step 70 "sweep_bwd_registers_$pass" python3 -m bench.sweep_attention \
        --out "$out/sweep_bwd_registers_$pass.json" --implementation mosaic --seq 4096 \
        --head-dim 128 64 --causal 1 --part bwd --config '{}' \
        '{"backward_memory_registers": 24}'
    done
    # JAX's cuDNN fwd+bwd (run 60: 2.00 ms at T 4096 hd 128) against the sum of its two
    # kernels under ncu (run 66: 0.41 + 1.17 ms): XLA's command buffers off, then on;
    # our Mosaic kernel beside it (causal: the route `auto` should take).
    for buffers in off on; do
      flags=$([ $buffers = off ] && echo --xla_gpu_enable_command_buffer=)
      step 90 "attention_buffers_$buffers" env XLA_FLAGS="$flags" python3 -m bench.run \
        --suite attention --out "$out/attention_buffers_$buffers.json" --seq 4096 \
        --set head_dim=128 dtype=bfloat16 \
        --only "jax.nn cudnn" "torch sdpa cudnn" "probjax auto" "probjax mosaic"
    done
    ;;
  31)
    # GQA's dK/dV summed in one Triton program per KV head (`group_dkv`) under its GPU
    # tests, then fwd+bwd with and without, 32 query heads over 8 (run 75: mixed, off).
    step 150 gpu_tests env OUT=/tmp/tests WORKERS=8 FILES=tests/test_gpu_attention.py \
      bash -c 'mkdir -p $OUT; LIMIT=130 bash bench/gpu_tests.sh -k "group_dkv"; \
        cat $OUT/gpu_tests_by_name.txt; cat $OUT/failures.txt 2>/dev/null; \
        tail -25 $OUT/gpu_tests.txt'
    step 250 sweep_group_dkv python3 -m bench.sweep_attention \
      --out "$out/sweep_group_dkv.json" --implementation triton --seq 4096 \
      --head-dim 128 64 --batch 2 --heads 32 --kv-heads 8 --causal 0 1 --part bwd \
      --config '{}' '{"group_dkv": true}'
    ;;
  32)
    # Our default on causal shapes since plain causal masks go to Mosaic first (run 82's
    # auto rows predate that route), beside both cuDNN routes; then the split-KV forward's
    # tiles x splits on the H100 (every sweep so far ran on the H200), MHA shapes too.
    suite 330 attention_causal --suite attention --seq 1024 4096 16384 \
      --set causal=True dtype=bfloat16 head_dim=64,128 \
      --only "probjax auto" "probjax mosaic" "jax.nn cudnn" "torch sdpa cudnn"
    step 250 sweep_decode python3 -m bench.sweep_decode --out "$out/sweep_decode.json" \
      --shape 1,32768,32 1,131072,32 8,131072,8 8,131072,32 --programs 132 264 528 1056
    ;;
  34)
    # Our default at T 16384 hd 64 causal, which the causal regime sends to Mosaic since
    # 6034ad7 (run 83's auto row there was cuDNN's 8.94 ms), beside both cuDNN routes.
    # Run 88 ran it, then Mosaic's `dq_rows` (removed after runs 87-88: slower).
    attention_causal_16k
    ;;
  35)
    # The Triton fused backward over one key tile (dQ stored, no atomics) under its GPU
    # tests, then fwd+bwd on the set-transformer shapes where torch flash led (run 76:
    # 64 sets x 4 heads, 1024 queries over 128 keys, hd 32: 0.157 ms vs our 0.164), and
    # over 64 keys, where "auto" now fuses; then stage 34.
    WORKERS=4 gpu_tests 150 -k "one_key_tile or triton_fused"
    sweep_set_bwd 200 sweep_one_key_tile 128 "32 64" '{}' "${one_key_tile[@]}" \
      "{\"block_k_dkv\": 128, \"block_q_dkv\": 32, $fused}"
    sweep_set_bwd 120 sweep_one_key_tile_64 64 "32 64" '{}' '{"backward_pass_impl": "triton_split"}'
    attention_causal_16k
    ;;
  36)
    # Runs 87 and 89: the one-key-tile GPU tests, the one-key-tile backward at hd 32 over
    # 128 and 64 keys (run 87, with Mosaic's since removed dq_rows), then 128 keys at
    # hd 64 and 32 again (run 89), after which hd <= 32 took 128-key dK/dV tiles.
    WORKERS=4 gpu_tests 100 -k one_key_tile
    sweep_set_bwd 90 sweep_one_key_tile 128 32 '{}' "${one_key_tile[@]}"
    sweep_set_bwd 60 sweep_one_key_tile_64 64 32 '{}' '{"backward_pass_impl": "triton_split"}'
    sweep_set_bwd 90 sweep_one_key_tile_hd64 128 "64 32" '{}' "${one_key_tile[0]}" \
      "{\"block_k_dkv\": 128, \"block_q_dkv\": 32, $fused}"
    ;;
  37)
    # Runs 90-92: the set-transformer shapes (64 sets x 4 heads,
    # 128 <-> 1024 elements, hd 32) on the new default beside torch SDPA, whose times
    # there vary 2x between runs (flash fwd+bwd at 1024 queries over 128 keys: 0.230,
    # 0.157, 0.301 ms in runs 70, 76, 90), so twice in one call (runs 91, 92: 0.161,
    # 0.157 vs our 0.152); then the Triton GPU tests.
    for i in 1 2; do
      suite 120 "set_transformer_$i" --suite set_transformer --set elements=1024 \
        --only "probjax auto" "probjax triton" "torch sdpa flash" "torch sdpa cudnn" "isab auto"
    done
    WORKERS=4 gpu_tests 200 -k "triton and not lowers"
    ;;
  38)
    # What the harness adds: JAX routes under the old grad-of-a-float32-loss timing and
    # the new fwd_bwd_program, torch SDPA on contiguous copies and on views of the JAX
    # layout; then the T 4096 hd 64/128 rows under the new harness.
    step 200 probe_harness python3 -m bench.probe_timing harness --rounds 2 \
      --out "$out/probe_harness.json"
    suite 300 attention_4096 --suite attention --seq 4096 --set head_dim=64,128 \
      dtype=bfloat16 --only "probjax auto" "probjax mosaic" "jax.nn cudnn" \
      "torch sdpa cudnn" "torch sdpa flash"
    ;;
  39)
    # What a dispatch adds (one call per program against 8 chained in one; run 94 chained
    # by a fori_loop, since replaced by stage 41's unrolled chain), then the T 16384
    # hd 128 rows under the new harness.
    step 150 probe_dispatch python3 -m bench.probe_timing dispatch \
      --out "$out/probe_dispatch.json"
    suite 330 attention_16384 --suite attention --seq 16384 --set head_dim=128 \
      dtype=bfloat16 --only "probjax auto" "probjax mosaic" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  40)
    # Which cuDNN kernels torch's SDPA runs, beside JAX's route to cuDNN, under ncu
    # (T 4096 hd 128, non-causal then causal).
    for causal in "" --causal; do
      step 200 "ncu_torch$causal" env NCU_LIMIT=180 bash bench/ncu.sh "$out" "torch$causal" \
        bench.attention_work jax.nn-cudnn torch-cudnn --launch 2 $causal
    done
    ;;
  41)
    # Per call, alone in a program and as 8 chained calls in one (unrolled), JAX's routes
    # and torch's, T 4096 hd 128 and hd 64.
    step 200 probe_dispatch python3 -m bench.probe_timing dispatch \
      --out "$out/probe_dispatch.json"
    step 150 probe_dispatch_64 python3 -m bench.probe_timing dispatch --head-dim 64 \
      --out "$out/probe_dispatch_64.json"
    ;;
  42)
    # Our default and both cuDNN routes per call inside a stack of 4 layers (one program
    # for JAX, eager for torch), T 4096 hd 64/128, causal and not.
    suite 450 attention_stack --suite attention --seq 4096 --set head_dim=64,128 \
      dtype=bfloat16 layers=4 --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  43)
    # Decoding (one query) alone and per call inside a stack of 4 layers, beside JAX's
    # and torch's cuDNN and torch's flash, without per-batch lengths (torch's SDPA
    # takes none).
    suite 270 decode_stack --suite decode --set q_len=1 ragged=false layers=1,4 \
      kv_len=32768,131072 --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn" \
      "torch sdpa flash"
    ;;
  44)
    # Gradient checks of every peer (dQ, dK, dV under a cotangent on the checked rows):
    # bf16 and float32 peers at T 1024 hd 64, then a decode training row beside torch.
    suite 120 grads_bf16 --suite attention --seq 1024 --set head_dim=64 dtype=bfloat16 \
      --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn" "torch sdpa flash" "torch flex"
    suite 70 grads_f32 --suite attention --seq 1024 --set head_dim=64 dtype=float32 \
      causal=false --only "probjax auto" "torch sdpa efficient" "torch flex"
    suite 150 grads_decode --suite decode --set q_len=128 kv_len=8192 ragged=false \
      --only "probjax auto" "torch sdpa flash" "torch sdpa cudnn"
    ;;
  45)
    # The gradient checks at T 4096 / 16384 (hd 64/128, causal and not) for our default
    # and every peer that ran there, then decode's training rows (run 99 cut them).
    gradient_rows 330 150
    ;;
  46)
    # Which cuDNN kernels each route runs where torch's cuDNN leads by more than a
    # dispatch: decode's training shape (8 x 128 queries over 8192 keys, 32 heads over 8;
    # run 100 fwd+bwd 2.240 vs 1.748 ms) and T 16384 hd 128 causal (14.82 vs 14.19);
    # then the split-KV plan at batch 1, 8 KV heads on the H100 (torch cuDNN 0.88x).
    step 150 ncu_decode_train env NCU_LIMIT=140 bash bench/ncu.sh "$out" decode_train \
      bench.attention_work cudnn torch-cudnn --shape 8,128,8192,32,8 --launch 1
    step 150 ncu_causal_16k env NCU_LIMIT=140 bash bench/ncu.sh "$out" causal_16k \
      bench.attention_work jax.nn-cudnn torch-cudnn --seq 16384 --causal --launch 1
    step 250 sweep_decode python3 -m bench.sweep_decode --out "$out/sweep_decode.json" \
      --shape 1,131072,8 1,32768,8 --programs 132 264 528 1056
    ;;
  47)
    # Decode training (8 x 128 queries over 8192 keys, 32 heads over 8): JAX's cuDNN route
    # runs torch's kernels (run 101) yet took 2.240 ms fwd+bwd to torch's 1.748: per call,
    # alone and 4 in a program, beside GQA run as MHA (K/V repeated) and our kernels.
    # Then decoding under the H100's tiles (64-key steps, 4 warps, one program per SM).
    step 200 probe_gqa python3 -m bench.probe_timing dispatch --out "$out/probe_gqa.json" \
      --shape 8,128,8192,32,8 --causal 0 --calls 4 --routes "probjax auto" \
      "jax.nn cudnn" "jax.nn cudnn+repeat_kv" "probjax mosaic" "probjax triton"
    suite 230 decode_q1 --suite decode --set q_len=1 ragged=false \
      --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  48)
    # Where GQA without a mask belongs: run 102 had our Mosaic kernel at 1.214 ms fwd+bwd
    # for 8 x 128 queries over 8192 keys, 32 heads over 8, torch SDPA cuDNN 1.739, JAX's
    # cuDNN route 2.269 (cuDNN's backward writes dK/dV per query head, then sums them).
    # Longer query blocks, self-attention, MHA and longer keys, one call per program.
    step 290 probe_grouped python3 -m bench.probe_timing dispatch \
      --out "$out/probe_grouped.json" --causal 0 --calls 1 \
      --routes "probjax cudnn" "probjax mosaic" --shape 8,128,8192,32,8 \
      8,512,8192,32,8 8,1024,8192,32,8 2,4096,4096,32,8 8,128,8192,32,32 \
      8,128,32768,32,8
    ;;
  49)
    # GQA without a mask up to 1024 queries now goes to Mosaic (run 103): its GPU tests,
    # then the decode suite's training rows (gradients checked) beside torch; then every
    # device event of JAX's cuDNN fwd+bwd at 128 queries over 8192 keys, MHA and GQA
    # (both ~0.4 ms over torch's same kernels: memsets? copies? idle?).
    gpu_tests 110 -k "grouped_cross or (mosaic_matches_oracle and none)"
    suite 200 decode_train --suite decode --set q_len=128 ragged=false kv_len=8192,32768 \
      --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    step 120 trace_cudnn python3 -m bench.trace_program --routes "probjax cudnn" \
      --shape 8,128,8192,32,32 8,128,8192,32,8
    ;;
  50)
    # Training where few query rows go to the split-KV Triton kernel (MHA 128 queries,
    # GQA 16 queries) and a batch-1 grouped call, our three kernels beside torch cuDNN.
    # (Run 104's trace: JAX's cuDNN backward zero-fills dK and dV, 2 x 164 us at MHA 128
    # over 8192 keys, and GQA's per-query-head dK/dV, 334 us; torch's does not.)
    step 330 probe_few_rows python3 -m bench.probe_timing dispatch \
      --out "$out/probe_few_rows.json" --causal 0 --calls 1 \
      --routes "probjax mosaic" "probjax triton" "probjax cudnn" \
      --shape 8,128,8192,32,32 8,16,8192,32,8 1,128,32768,32,8
    ;;
  51)
    # The split-KV GPU tests under the H100's decoding tiles (64-key steps, one program
    # per SM), then decode training at batch 1 (run 106, an H200: no rows, as the decode
    # suite times training at batch 8, 32 heads over 8 only).
    gpu_tests 120 -k "split_kv_decode or auto_picks or grouped_cross"
    suite 230 decode_train_b1 --suite decode --set q_len=128 ragged=false kv_len=8192 \
      batch=1 --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  52)
    # The split-KV Triton forward joined to the Mosaic backward (split_kv_forward) where
    # few query tiles leave the Mosaic forward's grid short (run 105, 1 x 128 queries over
    # 32768 keys, 32 heads over 8: Triton forward 0.167 ms, Mosaic 0.375, Mosaic fwd+bwd
    # 0.884), beside both alone; then the decode suite's training rows, MHA now too.
    step 300 probe_split_kv python3 -m bench.probe_timing dispatch \
      --out "$out/probe_split_kv.json" --causal 0 --calls 1 \
      --routes "probjax mosaic" "probjax mosaic+split_kv" "probjax triton" \
      --shape 1,128,32768,32,8 1,256,16384,32,8 2,128,32768,32,8 8,128,8192,32,8
    suite 250 decode_train --suite decode --set q_len=128 ragged=false kv_len=8192 \
      --only "probjax auto" "probjax triton" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  53)
    # Mosaic's default now joins the split-KV forward where its grid is short (run 108):
    # the GPU tests of that and of the join; then few query rows in training, where the
    # Mosaic backward's fused dQ writes a float32 [q_len, hd] partial per 128 keys (at 128
    # queries as many bytes as K and V) and the few_queries regime sends MHA to Triton
    # (run 108, 8 x 128 over 8192 keys: Triton 2.116 ms, torch 1.579): our kernels, with
    # dQ in its own kernel, and the join, beside torch; then batch-1 training rows.
    gpu_tests 120 -k "cross_attention_to_mosaic or split_kv_forward or split_kv_decode"
    step 330 probe_few_rows_dq python3 -m bench.probe_timing dispatch \
      --out "$out/probe_few_rows_dq.json" --causal 0 --calls 1 \
      --routes "probjax auto" "probjax triton" "probjax mosaic" \
        "probjax mosaic+set:fused_dq=False" "probjax mosaic+split_kv" \
      --shape 8,128,8192,32,32 1,128,32768,32,32 8,128,8192,32,8
    suite 120 decode_train_b1 --suite decode --set q_len=128 ragged=false kv_len=8192 \
      batch=1 --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  54)
    # Regime `cross` now sends MHA at 65-128 queries over >= 8192 keys to Mosaic too (run
    # 109): its GPU tests, then the decode suite's training rows at batch 1 and 8, GQA and
    # MHA, beside both cuDNN routes (stage 53's batch-1 step wrote no rows: the suite
    # timed training at batch 8 only).
    gpu_tests 100 -k "cross_attention_to_mosaic"
    suite 400 decode_train --suite decode --set q_len=128 ragged=false kv_len=8192 \
      --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  55)
    # The Mosaic backward's fused dQ at few queries (run 109, 8 x 128 over 8192 keys, MHA:
    # 1.927 ms fused, 1.828 with dQ in its own kernel; GQA 1.183 vs 1.219; batch 1 over
    # 32768, joined: 0.940 vs 1.276): more batches and keys, to find where the dQ kernel's
    # grid pays; then 96 queries (MHA), where both forwards run one 128-row tile a head.
    step 300 probe_fused_dq python3 -m bench.probe_timing dispatch \
      --out "$out/probe_fused_dq.json" --causal 0 --calls 1 \
      --routes "probjax mosaic" "probjax mosaic+set:fused_dq=False" \
      --shape 4,128,8192,32,32 16,128,8192,32,32 8,128,32768,32,32 16,128,8192,32,8
    step 120 probe_mha_96 python3 -m bench.probe_timing dispatch \
      --out "$out/probe_mha_96.json" --causal 0 --calls 1 \
      --routes "probjax auto" "probjax triton" --shape 8,96,8192,32,32
    ;;
  56)
    # MHA at one query tile a head now takes dQ's own kernel where its grid fills half a
    # wave (run 111): the cross regime's GPU tests, then the decode suite's training rows.
    gpu_tests 110 -k "cross_attention_to_mosaic"
    suite 330 decode_train --suite decode --set q_len=128 ragged=false kv_len=8192 \
      --only "probjax auto" "torch sdpa cudnn"
    ;;
  57)
    # The cross regime's untimed edges (attention.CROSS_MOSAIC_*): 4096 keys (GQA stays
    # on cuDNN, MHA at 128 queries on the split-KV Triton kernel) and hd 64, each beside
    # Mosaic and torch.
    step 260 probe_cross_edges python3 -m bench.probe_timing dispatch \
      --out "$out/probe_cross_edges.json" --causal 0 --calls 1 \
      --routes "probjax auto" "probjax mosaic" \
      --shape 8,128,4096,32,32 8,128,4096,32,8 8,1024,4096,32,8
    step 200 probe_cross_hd64 python3 -m bench.probe_timing dispatch \
      --out "$out/probe_cross_hd64.json" --causal 0 --calls 1 --head-dim 64 \
      --routes "probjax auto" "probjax mosaic" --shape 8,128,8192,32,8 8,128,8192,32,32
    ;;
  58)
    # Run 116 also timed stream-K decoding (`lean_programs`, its GPU test and a probe
    # beside the split plan): slower at 5 of 6 shapes, removed since with its steps here.
    # MHA training at 128 queries over 8192 keys (0.86x torch, run 112): each dK/dV
    # program of 128 keys runs two 64-row query tiles, little work to hide its K/V loads
    # behind; one warpgroup of 64 keys takes half the SMEM (two programs an SM?), and the
    # dQ kernel at 64 rows twice the programs.
    step 150 probe_dkv64 python3 -m bench.probe_timing dispatch \
      --out "$out/probe_dkv64.json" --causal 0 --calls 1 \
      --routes "probjax mosaic" "probjax mosaic+set:block_k_dkv=64,fused_dq=False" \
        "probjax mosaic+set:block_q_dq=64,fused_dq=False" \
        "probjax mosaic+set:block_k_dkv=64,block_q_dq=64,fused_dq=False" \
      --shape 8,128,8192,32,32 1,128,8192,32,32
    step 80 trace_mosaic python3 -m bench.trace_program --routes "probjax mosaic" \
      --shape 8,128,8192,32,32
    ;;
  59)
    # The H200's rows with gradients checked (issue 9: its rows predate the checks):
    # our default beside both cuDNN routes at T 4096 / 16384, then decode training.
    gradient_rows 400 170
    ;;
  60)
    # The H200's decoding rows with today's split plans (its Lq <= 16 rows are from run
    # 32, before the plans' per-kind fill, run 107): one and 16 queries without lengths,
    # beside both cuDNN routes (and torch flash at one query).
    suite 330 decode_q1 --suite decode --set q_len=1 ragged=false \
      --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn" "torch sdpa flash"
    suite 240 decode_q16 --suite decode --set q_len=16 ragged=false \
      --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  61)
    # MHA at one query tile a head over many keys now runs 64-key dK/dV programs (run 116,
    # 8 x 128 over 8192: 1.865 -> 1.731 ms): its GPU tests, then the other shapes of the
    # own-dQ rule beside the 128-key programs, one ring stage (three programs an SM?) and
    # torch.
    gpu_tests 100 -k "cross_attention_to_mosaic"
    step 330 probe_dkv64_rule python3 -m bench.probe_timing dispatch \
      --out "$out/probe_dkv64_rule.json" --causal 0 --calls 1 \
      --routes "probjax mosaic" "probjax mosaic+set:block_k_dkv=128" \
        "probjax mosaic+set:num_stages=1" \
      --shape 4,128,8192,32,32 16,128,8192,32,32 8,128,32768,32,32 8,96,8192,32,32
    ;;
  62)
    # One-slot rings (num_stages=1) after the race mended since run 117's crash: their GPU
    # test, then the own-dQ shapes beside the default's two slots (less shared memory a
    # program: more programs an SM?).
    gpu_tests 100 -k "one_slot_rings"
    step 200 probe_one_slot python3 -m bench.probe_timing dispatch \
      --out "$out/probe_one_slot.json" --causal 0 --calls 1 \
      --routes "probjax mosaic" "probjax mosaic+set:num_stages=1" \
      --shape 8,128,8192,32,32 16,128,8192,32,32
    ;;
  63)
    # Decoding one query over 8192 keys, batch 8, 32 heads over 8: 0.110 ms vs torch SDPA
    # cuDNN 0.096 (run 116). Where the time goes (kernels, merge, gaps) for ours and
    # torch's, and whether more splits (programs an SM) close it.
    step 120 trace_decode python3 -m bench.trace_program --part fwd --launches 5 \
      --routes "probjax auto" "torch sdpa cudnn" "torch sdpa flash" \
      --shape 8,1,8192,32,8 1,1,131072,32,8 8,1,131072,32,32
    step 150 probe_decode_splits python3 -m bench.probe_timing dispatch \
      --out "$out/probe_decode_splits.json" --causal 0 --calls 1 --forward-only \
      --routes "probjax triton" "probjax triton+set:num_splits=4" \
        "probjax triton+set:num_splits=8" "probjax triton+set:num_splits=4,num_stages=4" \
      --shape 8,1,8192,32,8
    ;;
  64)
    # Run 119: at batch 8 over 8192 keys (GQA) our kernels took 89.2 us against cuDNN's
    # 91.3 (the per-call gap is dispatch); cuDNN's one kernel for batch 8 MHA over 131k
    # keys took 5434 us (3.16 TB/s). Our kernels there and at batch 1 GQA 131k (the JAX
    # trace failed after torch's), then key steps, warps and ring depth at both.
    step 90 trace_decode python3 -m bench.trace_program --part fwd --launches 3 \
      --routes "probjax auto" --shape 1,1,131072,32,8 8,1,131072,32,32
    step 240 probe_decode_tiles python3 -m bench.probe_timing dispatch \
      --out "$out/probe_decode_tiles.json" --causal 0 --calls 1 --forward-only \
      --routes "probjax triton" "probjax triton+set:num_stages=4" \
        "probjax triton+set:num_stages=5" "probjax triton+set:block_k=128" \
        "probjax triton+set:block_k=128,num_warps=8" "probjax triton+set:block_k=128,num_stages=2" \
      --shape 8,1,131072,32,32 1,1,131072,32,8
    ;;
  66)
    # Batch 8 MHA over 131k keys, one query: our kernel 5562 us, cuDNN's 5434 (runs
    # 119-120; no key step, warp count or ring depth of ours closed it). Their memory
    # and warp-stall counters side by side, over 32k keys (run 102: 1.411 vs 1.369 ms a
    # call), a quarter of the bytes for ncu's replays to save and restore.
    step 200 ncu_decode_mha env NCU_LIMIT=180 \
      NCU_SECTIONS="SpeedOfLight MemoryWorkloadAnalysis WarpStateStats Occupancy LaunchStats" \
      bash bench/ncu.sh "$out" decode_mha bench.attention_work triton torch-cudnn \
      --shape 8,1,32768,32,32 --launch 1 --forward-only
    ;;
  67)
    # sm_90's split plans now fill waves 95% (was 90%): 8 programs take 16 splits, not 15
    # (12 of 132 SMs idle). Both in one run, with 33 and torch, then dQ's 16 splits beside
    # 15 for 8 heads of 128 queries over 65,536 keys.
    step 150 probe_split_fill python3 -m bench.probe_timing dispatch \
      --out "$out/probe_split_fill.json" --causal 0 --calls 1 --forward-only --rounds 2 \
      --routes "probjax triton" "probjax triton+set:num_splits=15" \
        "probjax triton+set:num_splits=33" \
      --shape 1,1,131072,32,8 1,1,32768,32,8
    step 120 probe_split_fill_dq python3 -m bench.probe_timing dispatch \
      --out "$out/probe_split_fill_dq.json" --causal 0 --calls 1 \
      --routes "probjax triton" "probjax triton+set:num_splits_dq=15" \
      --shape 1,128,65536,8,8
    # Does a TMA-fed forward read K/V faster than cp.async (ours 3.09 TB/s, cuDNN's 3.16,
    # batch 8 MHA over 131k keys)? Mosaic's forward as it is (one query padded to two
    # warpgroups of 64 rows, no split: its products are ~2.2 TFLOP beside 17 GB read).
    step 120 probe_decode_mosaic python3 -m bench.probe_timing dispatch \
      --out "$out/probe_decode_mosaic.json" --causal 0 --calls 1 --forward-only \
      --routes "probjax triton" "probjax mosaic" --shape 8,1,131072,32,32
    ;;
  68)
    # cuDNN's decoding kernel is an sm80 one (cp.async, runs 119-120), and torch reads
    # contiguous [B, H, T, D] copies where ours reads [B, T, H, D] (256-byte rows, a
    # head's keys strided): is the gap layout? Ours on head-major K/V beside ours, torch
    # on its copies and on the view of JAX's memory.
    step 300 probe_decode_layout env XLA_PYTHON_CLIENT_PREALLOCATE=false \
      python3 -m bench.probe_timing dispatch --out "$out/probe_decode_layout.json" \
      --causal 0 --calls 1 --forward-only --torch-layout view \
      --routes "probjax auto" "probjax auto+heads_major" \
      --shape 8,1,131072,32,32 1,1,131072,32,8 8,1,8192,32,8 1,1,32768,32,32 8,16,32768,32,8
    ;;
  69)
    # Under `jax.vmap` (an Equinox module's batch) the kernels now plan for the folded
    # batch: before, one example's plan ran batch times over (cross-attention 8 x 128
    # over 8192 keys: the split-KV join and fused dQ where the batch takes its own dQ
    # kernel). Vmapped one-example calls beside the batched call.
    step 200 probe_vmap_train python3 -m bench.probe_timing dispatch \
      --out "$out/probe_vmap_train.json" --causal 0 --calls 1 \
      --routes "probjax auto" "probjax auto+vmap" \
      --shape 8,128,8192,32,32 4,128,16384,32,8
    step 120 probe_vmap_decode python3 -m bench.probe_timing dispatch \
      --out "$out/probe_vmap_decode.json" --causal 0 --calls 1 --forward-only \
      --routes "probjax auto" "probjax auto+vmap" --shape 8,1,8192,32,8 8,1,32768,32,32
    ;;
  70)
    # Forward mode's Triton tangent kernel (session 35, CPU-tested and lowered only): its
    # GPU tests on every route (and the other kernels' higher derivatives), then
    # `jax.jvp` timed beside XLA's JVPs (ours and jax.nn's) at T 4096 / 16384, hd 64 /
    # 128, causal and not, with each program's scratch memory. 240 + 330 s: one call.
    gpu_tests 240 -k "forward_mode or higher_derivatives"
    suite 330 forward_mode --suite forward_mode --seq 4096 16384
    ;;
  71)
    # Forward mode's cuDNN-route GPU test (mended after run 137); where JAX's route to
    # cuDNN loses its 3-7% to torch's at B4 H8 T4096 hd 128 fwd+bwd (every device event,
    # memsets included); then the tangent kernel's tiles (`jax.jvp` of Triton pinned:
    # run 137 took 2.49 ms at hd 128 where Triton's forward takes ~0.5), with the forward
    # alone to subtract. 110 + 90 + 270 + 60 s.
    gpu_tests 100 -k "forward_mode_kernel_on_gpu"
    step 90 trace_cudnn python3 -m bench.trace_program --shape 4,4096,4096,8,8 \
      --routes "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    step 270 sweep_tangent python3 -m bench.sweep_attention --out "$out/sweep_tangent.json" \
      --implementation triton --seq 4096 --head-dim 64 128 --causal 0 1 --part tangent
    step 60 sweep_tangent_fwd python3 -m bench.sweep_attention --defaults --part fwd \
      --out "$out/sweep_tangent_fwd.json" --implementation triton --seq 4096 \
      --head-dim 64 128 --causal 0 1
    ;;
  72)
    # Decoding one query over 131k keys, batch 1, 32 heads over 8: cuDNN's kernels read
    # K/V at 4.1-4.2 TB/s on the H200, ours at 3.7-4.0 (runs 107, 134); the H100's gap is
    # 3% (run 119). The calls alone and per call in a stack of 4 layers, where JAX's
    # per-program costs (jax.nn's cuDNN call took 0.140 ms to torch's 0.130 in run 134)
    # are shared; then memory and stall counters side by side (H200 wanted).
    suite 150 decode_stack --suite decode --set batch=1 q_len=1 ragged=false layers=1,4 \
      kv_len=131072 --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    step 200 ncu_decode_gqa env NCU_LIMIT=180 \
      NCU_SECTIONS="SpeedOfLight MemoryWorkloadAnalysis WarpStateStats Occupancy LaunchStats" \
      bash bench/ncu.sh "$out" decode_gqa bench.attention_work triton torch-cudnn \
      --shape 1,1,131072,32,8 --launch 1 --forward-only
    ;;
  73)
    # Forward mode's tangent kernel at its own tiles (`TANGENT_TILES`, from run 138's
    # sweep): the tiles that sweep did not reach (hd 64's larger ones), then `jax.jvp`
    # beside XLA's JVPs again at the new defaults. 200 + 300 s.
    step 200 sweep_tangent python3 -m bench.sweep_attention --out "$out/sweep_tangent.json" \
      --implementation triton --seq 4096 --head-dim 64 128 --causal 0 1 --part tangent \
      --config '{"tangent_tiles": [64, 64, 4, 3]}' '{"tangent_tiles": [128, 64, 8, 2]}' \
      '{"tangent_tiles": [128, 64, 4, 2]}' '{"tangent_tiles": [128, 64, 8, 3]}' \
      '{"tangent_tiles": [128, 64, 4, 3]}' '{"tangent_tiles": [64, 64, 4, 4]}' \
      '{"tangent_tiles": [64, 128, 4, 2]}' '{}'
    suite 300 forward_mode --suite forward_mode --seq 4096 16384
    ;;
  74)
    # Forward mode with keys and values held fixed (a context's, as in a consistency
    # model's cross-attention): they reach the tangent kernel as symbolic zeros, which
    # skip 2 of its 6 products; beside the same `jax.jvp` along q, k and v. Then stage
    # 72's decode timings (its ncu step is left to stage 72). 60 + 60 + 150 s.
    for moving in q qkv; do
      step 60 "tangent_$moving" python3 -m bench.sweep_attention --defaults --part tangent \
        --out "$out/sweep_tangent_$moving.json" --implementation triton --seq 4096 \
        --head-dim 64 128 --causal 0 --moving "$moving"
    done
    suite 150 decode_stack --suite decode --set batch=1 q_len=1 ragged=false layers=1,4 \
      kv_len=131072 --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  75)
    # Decoding one query where torch's cuDNN led per call in run 134 (batch 1 and 8 over
    # 8k and 32k keys, by 1.5-15%; jax.nn's call of cuDNN's kernel trailed it alike): per
    # call alone and per layer in a stack of 16, where a model's one program shares
    # JAX's per-program cost (at 131k keys a stack of 4 closed the gap, runs 141-142).
    # 48 rows: 150 s.
    suite 150 decode_stack --suite decode --set batch=1,8 q_len=1 ragged=false \
      layers=1,16 kv_len=8192,32768 --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  76)
    # Stage 75's stacks again, each layer now reading its own K/V where one layer's fit
    # L2 (`layer_caches`): run 145's stack of 16 read one 34 MB cache from L2, 0.011 ms
    # per layer to 0.036 alone. Then memory and stall counters of ours and torch's
    # cuDNN at batch 8 MHA over 32k keys, where torch led by 1.5-3% (run 145). 40 + 200 s.
    suite 90 decode_stack --suite decode --set batch=1 q_len=1 ragged=false layers=16 \
      kv_len=8192,32768 --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    step 200 ncu_decode_mha env NCU_LIMIT=180 \
      NCU_SECTIONS="SpeedOfLight MemoryWorkloadAnalysis WarpStateStats Occupancy LaunchStats" \
      bash bench/ncu.sh "$out" decode_mha bench.attention_work triton torch-cudnn \
      --shape 8,1,32768,32,32 --launch 1 --forward-only
    ;;
  77)
    # MHA decoding on the H200, where torch's cuDNN led per call by 11% at batch 1 over
    # 32k keys and 5% at batch 8 over 131k (run 134; on the H100 1.9% and 1.1%, and
    # ncu timed the kernels alike at batch 8 over 32k, run 147): the calls, then
    # memory and stall counters of ours and torch's cuDNN at both shapes. 60 + 2 x 150 s.
    suite 90 decode_mha --suite decode --set q_len=1 ragged=false heads=32:32 \
      kv_len=32768,131072 --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    for shape in 1,1,32768,32,32 8,1,131072,32,32; do
      step 150 "ncu_decode_mha_$shape" env NCU_LIMIT=140 \
        NCU_SECTIONS="SpeedOfLight MemoryWorkloadAnalysis WarpStateStats Occupancy LaunchStats" \
        bash bench/ncu.sh "$out" "decode_mha_b${shape%%,*}" bench.attention_work triton \
        torch-cudnn --shape "$shape" --launch 1 --forward-only
    done
    ;;
  78)
    # Batch 8 MHA decoding, where ncu timed our kernel and torch's cuDNN alike (5.42
    # against 5.41 ms over 131k keys, 1.35 / 1.36 over 32k; runs 147-148) but the calls
    # took 5.674 against 5.456 ms (run 148, ours timed first, torch last): the routes in
    # turn, 3 rounds, torch on its copies and on the view of JAX's memory. 200 s.
    step 200 probe_decode_rounds env XLA_PYTHON_CLIENT_PREALLOCATE=false \
      python3 -m bench.probe_timing dispatch --out "$out/probe_decode_rounds.json" \
      --causal 0 --calls 1 --forward-only --torch-layout view --rounds 3 \
      --routes "probjax auto" "jax.nn cudnn" --shape 8,1,131072,32,32 8,1,32768,32,32
    ;;
  79)
    # Decoding one query again at 100 ms samples (`time_fn`): 20 ms samples spread JAX's
    # sync, 0.4 ms longer than torch's, as 2-3% over each call (run 152). With torch SDPA
    # pinned to flash, 0.93-0.99x our time at 20 ms samples (H100 run 98). 48 rows: 380 s.
    suite 380 decode --suite decode --set q_len=1 ragged=false \
      --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn" "torch sdpa flash"
    ;;
  80)
    # The timing's own sync at small decoding calls (`time_fn`): 20 and 100 ms samples of
    # at most 100 and 1000 calls, the routes in turn; calls under 1 ms carry JAX's sync
    # (0.41 ms longer than torch's, H100 run 152) over at most 100 calls. 150 s.
    step 150 probe_sample_length python3 -m bench.probe_sample_length \
      --out "$out/probe_sample_length.json" --shape 1,1,8192,32,8 1,1,32768,32,8 \
      8,1,32768,32,32 --sample-ms 20 100 --max-inner 100 1000 --rounds 1
    ;;
  81)
    # Training over a KV cache's shape, batch 8 MHA, 128 queries over 8192 keys: our
    # default (Mosaic, its own dQ kernel) 1.81 ms fwd+bwd, torch SDPA cuDNN 1.56, jax.nn's
    # route to cuDNN 1.94-1.96 (XLA's zero-fill of dK/dV; H100 runs 108-112). Its dK/dV
    # kernel took 1.02 ms (run 116), ~63% of DRAM peak for the K/V it reads and dK/dV it
    # writes. Programs over several key tiles (`key_tiles_dkv`: K / V of the next tile
    # loading while one computes, Q / dO loaded once), a one-slot ring (three programs
    # an SM), tiles; the GPU tests of the key tiles; then the suite's row. 360 + 70 + 100 s.
    step 360 sweep_mosaic_kv_train python3 -m bench.sweep_attention \
      --out "$out/sweep_mosaic_kv_train.json" --implementation mosaic --seq 128 \
      --kv-seq 8192 --batch 8 --heads 32 --head-dim 128 --causal 0 --part bwd --config \
      '{}' '{"num_stages": 1}' '{"key_tiles_dkv": 2}' '{"key_tiles_dkv": 4}' \
      '{"key_tiles_dkv": 8}' '{"key_tiles_dkv": 16}' '{"key_tiles_dkv": 4, "num_stages": 1}' \
      '{"block_k_dq": 128}' \
      '{"block_k_dkv": 128, "fused_dq": true}'
    gpu_tests 60 -k several_key_tiles
    mha_train_row
    ;;
  82)
    # Stage 81's shape (H100 run 156: 64-key programs over 16 key tiles, one an SM, 1.711
    # ms fwd+bwd against 1.708 with two one-tile programs an SM): two compute warpgroups
    # of 64 keys a program over several key tiles, each loading its half of the next
    # tile while one computes, Q / dO loaded once by the TMA warpgroup; then its GPU
    # tests. 300 + 90 s.
    step 300 sweep_mosaic_kv_tiles python3 -m bench.sweep_attention \
      --out "$out/sweep_mosaic_kv_tiles.json" --implementation mosaic --seq 128 \
      --kv-seq 8192 --batch 8 --heads 32 --head-dim 128 --causal 0 --part bwd --config \
      '{}' '{"block_k_dkv": 128}' '{"block_k_dkv": 128, "key_tiles_dkv": 2}' \
      '{"block_k_dkv": 128, "key_tiles_dkv": 4}' '{"block_k_dkv": 128, "key_tiles_dkv": 8}' \
      '{"block_k_dkv": 128, "key_tiles_dkv": 16}' \
      '{"block_k_dkv": 128, "key_tiles_dkv": 8, "backward_memory_registers": 24}'
    gpu_tests 80 -k several_key_tiles
    ;;
  83)
    # The default after runs 156-159 (dQ's own kernel beside 128-key dK/dV programs over
    # 16 key tiles): stage 81's suite row, the auto-selection GPU tests. 100 + 120 s.
    mha_train_row
    gpu_tests 110 -k "cross_attention_to_mosaic or several_key_tiles"
    ;;
  84)
    # Key-tile dK/dV programs beyond runs 156-161's MHA shapes (fwd+bwd, 128 queries):
    # 32 heads over 8, batch 8 over 8192 keys, whose default fuses dQ (1.19 ms, torch
    # 1.74): dQ's own kernel beside key tiles instead. (Run 167, batch 8 MHA over 32768
    # keys: 16 / 32 / 64 key tiles a program 5.897 / 5.891 / 5.916 ms, no gain.) 200 s.
    # Run 169: fused 1.204 ms, own dQ beside 16 / 4 key tiles 1.191 / 1.194 (within 1%).
    step 200 sweep_mosaic_kv_tiles_gqa python3 -m bench.sweep_attention \
      --out "$out/sweep_mosaic_kv_tiles_gqa.json" --implementation mosaic --seq 128 \
      --kv-seq 8192 --batch 8 --heads 32 --kv-heads 8 --head-dim 128 --causal 0 --part bwd \
      --config '{}' '{"fused_dq": false, "key_tiles_dkv": 16, "backward_memory_registers": 24,
      "block_k_dq": 128}' '{"fused_dq": false, "key_tiles_dkv": 4,
      "backward_memory_registers": 24, "block_k_dq": 128}'
    ;;
  85)
    # The Mosaic backward's GPU tests alone (of stages 1 and 65) on the code since 36e65ac,
    # then stage 83's suite row: every mask case, one-slot rings, key-tile programs, the
    # automatic cross-attention configs, FA3's backward and fused dQ under vmap. Run 162
    # passed 20 of the 30 in 290 s. 440 + 100 s.
    gpu_tests 440 -k "mosaic_matches_oracle or one_slot or several_key_tiles or \
cross_attention_to_mosaic or fa3_backward or fa3_launch_group_1 or fused_dq_under_vmap"
    mha_train_row
    ;;
  86 | 87)
    # T 16384 at 100 ms samples (its rows date from run 100's 20 ms samples, before the
    # Mosaic backward's FA3 register mode): our default beside both cuDNN routes, causal
    # and not, hd 128 (86) or 64 (87). 420 s.
    dim=$([ "$1" = 86 ] && echo 128 || echo 64)
    suite 420 "attention_16384_hd$dim" --suite attention --seq 16384 --set head_dim=$dim \
      dtype=bfloat16 --only "probjax auto" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  88)
    # Long self-attention at hd 128: automatic selection joins our Mosaic forward to
    # cuDNN's backward (`cudnn_backward`; runs 164-166, T 16384: our forward 3.53 ms
    # causal against cuDNN's 3.84, cuDNN's backward the faster). Its GPU tests, then
    # the rows at T 16384, the join beside our Mosaic kernels alone and both cuDNN
    # routes. 130 + 150 s.
    gpu_tests 120 -k "joined_to_cudnn_backward or auto_picks_cudnn_on_sm90"
    suite 150 attention_16384_joined --suite attention --seq 16384 --set head_dim=128 \
      dtype=bfloat16 --only "probjax auto" "probjax mosaic" "jax.nn cudnn" "torch sdpa cudnn"
    ;;
  89)
    # What runs 171-172 left of stage 1 on 3171325's attention code: stage 1's selection
    # without the 65 tests those runs passed (18 left: forward mode, higher derivatives,
    # Mosaic softcap, fused dQ under vmap, ...). 300 s. Stale once attention's code changes.
    mapfile -t passed < <(passed_in bench/results/h100_gpu_tests_run17[12].txt)
    FILES=tests/test_gpu_attention.py gpu_tests 300 -k "not schedules_and_two_warpgroup" \
      "${passed[@]}"
    ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
