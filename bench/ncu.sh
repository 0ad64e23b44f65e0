#!/usr/bin/env bash
# Hardware counters of attention kernels (ours and peers'), in one process:
#   bash bench/ncu.sh OUTDIR NAME MODULE ARGS...   (e.g. NAME decode, MODULE
#   bench.profile_decode; NAME attention, MODULE bench.attention_work --launch 1).
# NCU_LIMIT (seconds, default 300): stay under the caller's own limit, so the cleanup runs.
# Writes OUTDIR/ncu_NAME.txt and prints each kernel's key lines. Needs `ncu`. Keep a
# kernel filter (default: Mosaic GPU's `*_mosaic_gpu`, Triton's `probjax*`, cuDNN's and
# torch's; NCU_KERNELS replaces it, e.g. to add XLA's fusions): profiling every kernel
# (XLA's autotuning included) ran past 200 s on the H200. NCU_SECTIONS replaces the
# sections read (default: SpeedOfLight Occupancy LaunchStats).
set -u
out=$1 name=$2; shift 2
log="$out/ncu_$name.txt"
keys='Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|Warp Cycles Per Issued|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Dynamic Shared|Waves Per SM|Grid Size|Block Size'
# Kernel replay saves and restores the device memory the process holds: without JAX's
# preallocation (75% of the GPU) that is MBs, not ~100 GB a pass (run 47 timed out on it).
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${NCU_LIMIT:-300}" ncu --clock-control none \
    -k "${NCU_KERNELS:-regex:probjax|mosaic_gpu|sdpa|fmha|flash|fprop|dgrad|cudnn}" \
    $(printf -- '--section %s ' ${NCU_SECTIONS:-SpeedOfLight Occupancy LaunchStats}) \
    python3 -m "$@" >"$log" 2>&1
status=$?
# A cut ncu leaves its target running, holding the GPU (run 47's next step found none).
pkill -9 -f "python3 -m $1" 2>/dev/null
echo "== kernels (rc $status)"
grep -E "^case|^[a-z].* (fwd|fwd\+bwd) |^  [a-zA-Z_].*\(|$keys" "$log" | grep -v "^==PROF" | cut -c1-120
