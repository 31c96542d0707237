[ -d /tmp/site/mlx ] || bash .device/p2/device-mlx.sh install >/dev/null
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg DS4_MLX_CACHE=/tmp/dscache MLX_PTX_CACHE_DIR=/tmp/ptx
[ -d /tmp/ptx ] || tar xzf .device/s32/ptx.tgz -C /tmp
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
R=$PWD
sweep() { # tree tag launches...
  local t=$1 tag=$2; shift 2
  (cd $t/benchmarks && PYTHONPATH=/tmp/site:$t timeout 120 $NCU --clock-control none --kernel-name regex:ds_mv --metrics gpu__time_duration.sum \
   --csv python3 mv_sweep.py $OUT/lab_$tag.json --only "$@" > $OUT/ncu_$tag.csv 2>&1; echo $tag rc $?;
   PYTHONPATH=/tmp/site:$t python3 mv_sweep.py --summarize $OUT/ncu_$tag.csv $OUT/lab_$tag.json)
}
sweep $R/.device/head head "gateup+sh xq qy direct" "q_b rms direct" "idx q_b f16 direct"
sweep $R signs "gateup+sh xq qy direct"
cd $R/.device/head && PYTHONPATH=/tmp/site:$PWD timeout 300 $NCU --graph-profiling node --clock-control none --cache-control none \
  --metrics gpu__time_duration.sum --csv python3 benchmarks/kernel_profile.py --layers 43 --ctx 2100 > $OUT/kp43.csv 2>$OUT/kp43.err
echo kp rc $?; PYTHONPATH=/tmp/site:$PWD python3 benchmarks/kernel_profile.py --summarize $OUT/kp43.csv > $OUT/kp43.txt; head -45 $OUT/kp43.txt
gzip -f $OUT/kp43.csv
# --- c3
[ -d /tmp/site/mlx ] || bash .device/p2/device-mlx.sh install >/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg DS4_MLX_CACHE=/tmp/dscache MLX_PTX_CACHE_DIR=/tmp/ptx
[ -d /tmp/ptx ] || tar xzf .device/s32/ptx.tgz -C /tmp
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 120 $NCU --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv python3 .device/s32/probe.py > $OUT/probe.csv 2>&1; echo rc $?
grep -v '^"' $OUT/probe.csv | tail -5
python3 - <<'P'
import csv, os
rows=[r for r in csv.reader(l for l in open(os.environ['OUT']+'/probe.csv') if l.startswith('"'))]
h=rows[0]; n,v,u,g=h.index('Kernel Name'),h.index('Metric Value'),h.index('Metric Unit'),h.index('Grid Size')
for r in rows[1:]:
    if len(r)>v and ('probe' in r[n] or 'comp_write' in r[n] or 'Multiply' in r[n] or 'binary' in r[n]): print(r[n][:60], r[g], r[v], r[u])
P
# --- c4
[ -d /tmp/site/mlx ] || bash .device/p2/device-mlx.sh install >/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg DS4_MLX_CACHE=/tmp/dscache MLX_PTX_CACHE_DIR=/tmp/ptx
[ -d /tmp/ptx ] || tar xzf .device/s32/ptx.tgz -C /tmp
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 150 $NCU --clock-control none --cache-control none --kernel-name regex:"mark|comp_write|ds_mv" --metrics gpu__time_duration.sum --csv python3 .device/s32/probe2.py > $OUT/probe2.csv 2>&1; echo rc $?
grep -v '^"' $OUT/probe2.csv | tail -3
python3 - <<'P'
import csv, os
rows=[r for r in csv.reader(l for l in open(os.environ['OUT']+'/probe2.csv') if l.startswith('"'))]
h=rows[0]; n,v=h.index('Kernel Name'),h.index('Metric Value')
cur=None; acc={}
for r in rows[1:]:
    if len(r)<=v: continue
    if 'mark_' in r[n]: cur=r[n].split('mark_')[1].split('(')[0]; acc[cur]=[]; continue
    if cur: acc[cur].append(r[v])
for k,x in acc.items(): print(k, x)
P
# --- c5
[ -d /tmp/site/mlx ] || bash .device/p2/device-mlx.sh install >/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg DS4_MLX_CACHE=/tmp/dscache MLX_PTX_CACHE_DIR=/tmp/ptx
[ -d /tmp/ptx ] || tar xzf .device/s32/ptx.tgz -C /tmp
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 150 $NCU --clock-control none --cache-control none --kernel-name regex:"mark|comp_write|ds_mv" --metrics gpu__time_duration.sum --csv python3 .device/s32/probe3.py > $OUT/probe3.csv 2>&1; echo rc $?
grep -v '^"' $OUT/probe3.csv | tail -3
python3 - <<'P'
import csv, os
rows=[r for r in csv.reader(l for l in open(os.environ['OUT']+'/probe3.csv') if l.startswith('"'))]
h=rows[0]; n,v=h.index('Kernel Name'),h.index('Metric Value')
cur=None; acc={}
for r in rows[1:]:
    if len(r)<=v: continue
    if 'mark_' in r[n]: cur=r[n].split('mark_')[1].split('(')[0]; acc[cur]=[]; continue
    if cur: acc[cur].append(r[v])
for k,x in acc.items(): print(k, x)
P
# --- c6
[ -d /tmp/site/mlx ] || bash .device/p2/device-mlx.sh install >/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg DS4_MLX_CACHE=/tmp/dscache MLX_PTX_CACHE_DIR=/tmp/ptx
[ -d /tmp/ptx ] || tar xzf .device/s32/ptx.tgz -C /tmp
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 100 python3 -m pytest -q -x tests/test_fused_kernels.py -k "attend_one or comp_write or emit or index_inputs or pool" > $OUT/gpu_tests.txt 2>&1; echo tests rc $?; tail -2 $OUT/gpu_tests.txt
timeout 80 python3 -m pytest -q -x tests/test_session.py -k "gpu_decode or quantized_x" > $OUT/gpu_tests2.txt 2>&1; echo tests2 rc $?; tail -2 $OUT/gpu_tests2.txt
timeout 80 $NCU --graph-profiling node --clock-control none --cache-control none --kernel-name regex:"attn_one|comp_write|marker" \
  --metrics gpu__time_duration.sum --csv python3 benchmarks/kernel_profile.py --layers 4 --ctx 2100 > $OUT/kp4.csv 2>$OUT/kp4.err
echo kp rc $?; python3 benchmarks/kernel_profile.py --summarize $OUT/kp4.csv | head -8
cd benchmarks && timeout 300 python3 ab_in_process.py ../.device/head --shape full --prefill 2100 --rounds 40 \
  --decode 32 --seconds 90 --json $OUT/ab.json > $OUT/ab.log 2>&1; echo ab rc $?; tail -3 $OUT/ab.log
# --- c7
[ -d /tmp/site/mlx ] || bash .device/p2/device-mlx.sh install >/dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/xdg DS4_MLX_CACHE=/tmp/dscache MLX_PTX_CACHE_DIR=/tmp/ptx
[ -d /tmp/ptx ] || tar xzf .device/s32/ptx.tgz -C /tmp
NCU=$(ls /opt/nvidia/nsight-compute/*/ncu | head -1)
timeout 40 python3 -m pytest -q -x tests/test_fused_kernels.py -k "index_scores" > $OUT/gpu_tests3.txt 2>&1; echo tests rc $?; tail -1 $OUT/gpu_tests3.txt
timeout 50 $NCU --graph-profiling node --clock-control none --cache-control none --kernel-name regex:"index_scores|attn_one|comp_write|marker" \
  --metrics gpu__time_duration.sum --csv python3 benchmarks/kernel_profile.py --layers 4 --ctx 2100 > $OUT/kp4b.csv 2>/dev/null
echo kp rc $?; python3 benchmarks/kernel_profile.py --summarize $OUT/kp4b.csv | head -8
cd benchmarks && timeout 200 python3 ab_in_process.py ../.device/head --shape full --prefill 2100 --rounds 40 \
  --decode 32 --seconds 90 --json $OUT/ab2.json > $OUT/ab2.log 2>&1; echo ab rc $?; tail -2 $OUT/ab2.log
