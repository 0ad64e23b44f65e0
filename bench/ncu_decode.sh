#!/usr/bin/env bash
# Hardware counters of decode kernels (ours and torch's), one launch a case, in one
# process: `bash bench/ncu_decode.sh OUTDIR CASE...` (cases: bench/profile_decode.py).
# Needs `ncu`. Keep the kernel filter: profiling every kernel (XLA's autotuning
# included) ran past 200 s on the H200.
set -u
out=$1; shift
log="$out/ncu_decode.txt"
keys='Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Dynamic Shared|Waves Per SM|Grid Size|Block Size'
timeout 300 ncu --clock-control none -k 'regex:probjax|sdpa|fmha|flash|fprop|cudnn' \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    python3 -m bench.profile_decode "$@" >"$log" 2>&1
echo "== kernels (rc $?)"
grep -E "^case|^  [a-zA-Z_].*\(|$keys" "$log" | grep -v "^==PROF" | cut -c1-120
