#!/bin/bash
# The next device session's plan (thirty-first session's end), one call after the MLX staging, from the repo root.
# Here first:
#   mkdir -p .device/head && git archive HEAD ds4_mlx custom_kernels benchmarks | tar -x -C .device/head
#   git apply benchmarks/results/h200_s31_next_{configs,iq2_signs,side_by_side}.patch   (in this order)
# (carry .device/head). The configs patch gives the grouped out_a (8, 4, 1) and the down sum of quantized mid
# (8, 2, 1), each faster by itself in this session's sweeps (15.4 against 18.0 µs, 17.0 against 18.3). The signs
# patch reads gate+up's IQ2 sign bytes (parity included) from a 128-byte threadgroup table, one word a bank (so
# lanes never conflict), and reuses the negative-byte flags: the routed loop's SASS drops from 1105 to 978
# instructions a pass (LOP3 321 -> 225, no POPC). Both pass the sim and compile tests. Keep each if its launch
# ("out_a g8 direct", "down+sh xq direct", "gateup+sh xq qy direct") and the whole step are faster; else find why
# out_a lost 2.2 µs at (4, 4, 1) this session. The side-by-side patch lets one-simdgroup row groups share a
# threadgroup (config (NR, 1, RG, PG)): q_b's launch ran 32-thread threadgroups, which cap an SM at 32 of its 64
# warps (Nsight: 50 % theoretical, 40 % achieved occupancy). With NSG 1 the row sums finish in registers, with
# no threadgroup barrier. It passes the sim tests (a wrong row-group index fails 7) and the compile checks; the
# sweep below times q_b and the indexer's q_b at PG 2 and 4. Set MV_RMS's / MV_PLAIN's short-row default to the
# best PG only after an A/B.
# Two calls (one would pass the 600 s limit): PART=1 (tests, kernel sweeps), then PART=2 (the whole step).
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
if [ "${PART:-1}" = 1 ]; then
timeout 150 python3 -m pytest -q -x tests/test_kernels.py tests/test_kernels_compile.py -k "mv_reg or dispatch or quantized" \
  > $OUT/gpu_tests.txt 2>&1; echo tests rc $?; tail -2 $OUT/gpu_tests.txt
(cd benchmarks && timeout 200 $NCU --clock-control none --kernel-name regex:ds_mv --metrics gpu__time_duration.sum \
  --csv python3 mv_sweep.py $OUT/lab.json --only "out_a g8 direct" "down+sh xq direct" "gateup+sh xq qy direct" "q_b rms direct" \
  "idx q_b f16 direct" > $OUT/ncu_mv.csv 2>&1;
  echo mv rc $?; python3 mv_sweep.py --summarize $OUT/ncu_mv.csv $OUT/lab.json)
else
cd benchmarks && timeout 280 python3 ab_in_process.py ../.device/head --shape full --prefill 2100 --rounds 40 \
  --decode 32 --seconds 90 --json $OUT/ab.json > $OUT/ab.log 2>&1; echo ab rc $?; tail -3 $OUT/ab.log
fi
