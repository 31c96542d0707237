#!/bin/bash
# The next device session's plan for the two patches prepared (not run on a GPU) in the thirtieth session, in one
# call after the MLX staging, from the repo root. Here first:
#   mkdir -p .device/head && git archive HEAD ds4_mlx custom_kernels | tar -x -C .device/head
#   git apply benchmarks/results/h200_s30_next_q2k_planes.patch benchmarks/results/h200_s30_next_topk_early_exit.patch
# (carry .device/head). Keep the Q2_K plane groups only if "down+sh direct" beats mv.body's 30.9 µs; then switch
# MV_SUM on for Q2_K at the best config and A/B the whole step against .device/head.
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 120 python3 -m pytest -q -x tests/test_kernels.py tests/test_fused_kernels.py -k "mv_reg or top_k_rows" \
  > $OUT/gpu_tests.txt 2>&1
echo tests rc $?; tail -2 $OUT/gpu_tests.txt
for tree in . .device/head; do
  PYTHONPATH=/tmp/site:$PWD/$tree timeout 60 $NCU --clock-control none --kernel-name regex:topk \
    --metrics gpu__time_duration.sum --csv python3 benchmarks/results/h200_s30_topkbench.py > $OUT/ncu_topk_${tree//[.\/]/}.csv 2>&1
  echo topk $tree rc $?
done
(cd benchmarks && timeout 150 $NCU --clock-control none --kernel-name regex:ds_mv --metrics gpu__time_duration.sum \
  --csv python3 mv_sweep.py $OUT/lab_down.json --only "down+sh" "down+sh direct" > $OUT/ncu_down.csv 2>&1;
  echo down rc $?; python3 mv_sweep.py --summarize $OUT/ncu_down.csv $OUT/lab_down.json)
