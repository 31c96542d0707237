#!/bin/bash
# The next device session's plan for the three patches prepared (not run on a GPU) in the thirtieth session, in one
# call after the MLX staging, from the repo root. Here first:
#   mkdir -p .device/head && git archive HEAD ds4_mlx custom_kernels benchmarks | tar -x -C .device/head
#   git apply benchmarks/results/h200_s30_next_{q2k_planes,topk_early_exit,iq2_sign_alu}.patch
# (carry .device/head). Keep the Q2_K plane groups only if "down+sh direct" beats mv.body's "down+sh" (30.9 µs);
# then switch MV_SUM on for Q2_K at the best config. Keep the sign masks in ALU ops if "gateup+sh xq direct" beats
# the head tree's. Then A/B the whole step against .device/head (ab_in_process.py).
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 120 python3 -m pytest -q -x tests/test_kernels.py tests/test_fused_kernels.py -k "mv_reg or xq or top_k_rows" \
  > $OUT/gpu_tests.txt 2>&1
echo tests rc $?; tail -2 $OUT/gpu_tests.txt
for tree in . .device/head; do
  tag=${tree//[.\/]/}; tag=${tag:-patched}
  PYTHONPATH=/tmp/site:$PWD/$tree timeout 60 $NCU --clock-control none --kernel-name regex:topk \
    --metrics gpu__time_duration.sum --csv python3 benchmarks/results/h200_s30_topkbench.py > $OUT/ncu_topk_$tag.csv 2>&1
  echo topk $tag rc $?
  (cd $tree/benchmarks && timeout 150 $NCU --clock-control none --kernel-name regex:ds_mv --metrics \
    gpu__time_duration.sum --csv python3 mv_sweep.py $OUT/lab_$tag.json --only "down+sh" "down+sh direct" \
    "gateup+sh xq direct" > $OUT/ncu_mv_$tag.csv 2>&1; echo mv $tag rc $?;
    python3 mv_sweep.py --summarize $OUT/ncu_mv_$tag.csv $OUT/lab_$tag.json)
done
# Why q_b still runs at ~2 TB/s: the full Nsight Compute profile of its launch (the third of five is the one to read).
(cd benchmarks && timeout 120 $NCU --set full --kernel-name regex:ds_mv python3 mv_sweep.py $OUT/lab_qb.json --default \
  --only "q_b rms direct" > $OUT/ncu_qb_full.txt 2>&1; echo qb full rc $?)
