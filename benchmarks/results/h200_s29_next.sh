#!/bin/bash
# The next device session's plan for h200_s29_hc_mix_pre.patch, in one call (~450 s with a warm PTX cache).
# Here first: git apply benchmarks/results/h200_s29_hc_mix_pre.patch, then
#   mkdir -p .device/base && git archive a818eb1 ds4_mlx custom_kernels | tar -x -C .device/base
# and run this from the repo root on the device (carry .device/base), after the MLX staging.
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 120 python3 -m pytest -q -x tests/test_fused_kernels.py -k "hc_" > $OUT/gpu_hc.txt 2>&1
echo hc tests rc $?; tail -2 $OUT/gpu_hc.txt
timeout 60 $NCU --clock-control none --kernel-name regex:ds_hc --metrics gpu__time_duration.sum --csv \
  python3 benchmarks/results/h200_s29_hcbench.py 5 > $OUT/ncu_hc.csv 2>&1
echo ncu rc $?
(cd benchmarks && timeout 300 python3 ab_in_process.py ../.device/base --shape full --prefill 2100 --rounds 40 \
  --decode 32 --seconds 100 --json $OUT/ab.json > $OUT/ab.log 2>&1; echo ab rc $?; tail -2 $OUT/ab.log)
