# The thirty-first session's device calls, in order (each after device-mlx.sh stage; .device/ holds the staged
# MLX-CUDA (p1, p2), the PTX cache (s31) and the HEAD tree eec663d (head)).

# --- call 1: run1.sh
[ -d /tmp/site/mlx ] || bash .device/p2/device-mlx.sh install >/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg DS4_MLX_CACHE=/tmp/dscache
export MLX_PTX_CACHE_DIR=/tmp/ptx; tar xzf .device/s31/ptx.tgz -C /tmp
bash benchmarks/results/h200_s30_next.sh
tar czf $OUT/ptx.tgz -C /tmp ptx

# --- call 2: run2.sh
[ -d /tmp/site/mlx ] || bash .device/p2/device-mlx.sh install >/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg DS4_MLX_CACHE=/tmp/dscache
export MLX_PTX_CACHE_DIR=/tmp/ptx; [ -d /tmp/ptx ] || tar xzf .device/s31/ptx.tgz -C /tmp
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 150 python3 -m pytest -q -x tests/test_kernels.py tests/test_fused_kernels.py tests/test_kernels_compile.py -k "mv_reg or xq or top_k_rows or dispatch" > $OUT/gpu_tests.txt 2>&1
echo tests rc $?; tail -2 $OUT/gpu_tests.txt
timeout 60 $NCU --clock-control none --kernel-name regex:topk --metrics gpu__time_duration.sum --csv python3 benchmarks/results/h200_s30_topkbench.py 2>&1 | grep -o '"ns","[0-9,]*"' | tr -d '",ns' | tr '\n' ' ' > $OUT/topk_patched.txt; echo topk; cat $OUT/topk_patched.txt; echo
(cd benchmarks && timeout 240 $NCU --clock-control none --kernel-name regex:ds_mv --metrics \
    gpu__time_duration.sum --csv python3 mv_sweep.py $OUT/lab.json --only "q_b rms direct" "out_b direct" \
    "qa+kv rms direct" "out_a g8 direct" "down+sh direct" "lm head direct" > $OUT/ncu_mv.csv 2>&1; echo mv rc $?;
    python3 mv_sweep.py --summarize $OUT/ncu_mv.csv $OUT/lab.json)

# --- call 3: run3.sh
[ -d /tmp/site/mlx ] || bash .device/p2/device-mlx.sh install >/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg DS4_MLX_CACHE=/tmp/dscache
export MLX_PTX_CACHE_DIR=/tmp/ptx; [ -d /tmp/ptx ] || tar xzf .device/s31/ptx.tgz -C /tmp
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
(cd benchmarks && timeout 60 $NCU --clock-control none --kernel-name regex:ds_mv --metrics \
    gpu__time_duration.sum --csv python3 mv_sweep.py $OUT/lab.json --only "out_a g8 direct" "q_b rms direct" > $OUT/ncu_mv.csv 2>&1; echo mv rc $?;
    python3 mv_sweep.py --summarize $OUT/ncu_mv.csv $OUT/lab.json)
cd benchmarks && timeout 420 python3 ab_in_process.py ../.device/head --shape full --prefill 2100 --rounds 40 --decode 32 --seconds 100 --json $OUT/ab.json > $OUT/ab.log 2>&1; echo ab rc $?; tail -8 $OUT/ab.log

# --- call 4: run4.sh
[ -d /tmp/site/mlx ] || bash .device/p2/device-mlx.sh install >/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg DS4_MLX_CACHE=/tmp/dscache
export MLX_PTX_CACHE_DIR=/tmp/ptx; [ -d /tmp/ptx ] || tar xzf .device/s31/ptx.tgz -C /tmp
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
(cd .device/head/benchmarks && PYTHONPATH=/tmp/site:$PWD/.. timeout 60 $NCU --clock-control none --kernel-name regex:ds_mv --metrics \
    gpu__time_duration.sum --csv python3 mv_sweep.py $OUT/lab.json --only "out_a g8 direct" > $OUT/ncu_mv.csv 2>&1; echo mv rc $?;
    python3 mv_sweep.py --summarize $OUT/ncu_mv.csv $OUT/lab.json)
timeout 420 python3 benchmarks/results/h200_s30_sensitivity.py --rounds 6 > $OUT/sens.log 2>&1; echo sens rc $?; tail -9 $OUT/sens.log
tar czf $OUT/ptx.tgz -C /tmp ptx

# --- call 5: run5.sh
[ -d /tmp/site/mlx ] || bash .device/p2/device-mlx.sh install >/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg DS4_MLX_CACHE=/tmp/dscache
export MLX_PTX_CACHE_DIR=/tmp/ptx; [ -d /tmp/ptx ] || tar xzf .device/s31/ptx.tgz -C /tmp
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 150 python3 -m pytest -q -x tests/test_kernels.py tests/test_fused_kernels.py tests/test_kernels_compile.py -k "mv_reg or xq or quantized or dispatch or hc_pre" > $OUT/gpu_tests.txt 2>&1
echo tests rc $?; tail -2 $OUT/gpu_tests.txt
timeout 100 python3 -m pytest -q -x tests/test_session.py -k "gpu_decode or quantized_x" > $OUT/gpu_tests2.txt 2>&1; echo tests2 rc $?; tail -2 $OUT/gpu_tests2.txt
(cd benchmarks && timeout 100 $NCU --clock-control none --kernel-name regex:ds_mv --metrics \
    gpu__time_duration.sum --csv python3 mv_sweep.py $OUT/lab.json --only "gateup+sh xq direct" "gateup+sh xq qy direct" \
    "down+sh direct" "down+sh xq direct" > $OUT/ncu_mv.csv 2>&1; echo mv rc $?;
    python3 mv_sweep.py --summarize $OUT/ncu_mv.csv $OUT/lab.json)
cd benchmarks && timeout 280 python3 ab_in_process.py ../.device/head --shape full --prefill 2100 --rounds 40 --decode 32 --seconds 90 --json $OUT/ab.json > $OUT/ab.log 2>&1; echo ab rc $?; tail -3 $OUT/ab.log
