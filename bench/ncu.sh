#!/usr/bin/env bash
# Hardware counters of attention kernels (ours and peers'), in one process:
#   bash bench/ncu.sh OUTDIR NAME MODULE ARGS...   (e.g. NAME decode, MODULE
#   bench.profile_decode; NAME attention, MODULE bench.attention_work --launch 1).
# Writes OUTDIR/ncu_NAME.txt and prints each kernel's key lines. Needs `ncu`. Keep the
# kernel filter (Mosaic GPU's `*_mosaic_gpu`, Triton's `probjax*`, cuDNN's and torch's):
# profiling every kernel (XLA's autotuning included) ran past 200 s on the H200.
set -u
out=$1 name=$2; shift 2
log="$out/ncu_$name.txt"
keys='Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Dynamic Shared|Waves Per SM|Grid Size|Block Size'
timeout 300 ncu --clock-control none -k 'regex:probjax|mosaic_gpu|sdpa|fmha|flash|fprop|dgrad|cudnn' \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    python3 -m "$@" >"$log" 2>&1
echo "== kernels (rc $?)"
grep -E "^case|^[a-z].* (fwd|fwd\+bwd) |^  [a-zA-Z_].*\(|$keys" "$log" | grep -v "^==PROF" | cut -c1-120
