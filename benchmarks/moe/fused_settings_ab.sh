#!/usr/bin/env bash
# The one-launch NVFP4 layer's untimed settings (RESULTS.md, "Session 41 note"), in one device call of ~560 s:
# spans with counters passed (each row with its error against the reference), then the kernel's GPU tests.
#     OUT=dir bash benchmarks/moe/fused_settings_ab.sh
set -u
mkdir -p $OUT
start=$(date +%s)
V1='[{"counters_passed": true},
 {"counters_passed": true, "fused_settings": {"down_lag": 1}},
 {"counters_passed": true, "fused_settings": {"down_lag": 1, "smem_pad": 16384}},
 {"counters_passed": true, "fused_settings": {"down_lag": 1, "smem_pad": 40960}},
 {"counters_passed": true, "fused_settings": {"smem_pad": 16384}},
 {"counters_passed": true, "fused_settings": {"down_step_waits": true}},
 {"counters_passed": true, "fused_settings": {"down_step_waits": true, "down_lag": 1}}]'
V8='[{"counters_passed": true}, {"counters_passed": true, "fused": true},
 {"counters_passed": true, "fused": true, "fused_settings": {"down_lag": 1}},
 {"counters_passed": true, "fused": true, "fused_settings": {"down_lag": 4}},
 {"counters_passed": true, "fused": true, "fused_settings": {"down_lag": 1, "smem_pad": 24576}},
 {"counters_passed": true, "fused": true,
  "fused_settings": {"down_overlap": true, "down_step_waits": true, "down_lag": 1}}]'
left() { echo $(( 560 - ($(date +%s) - start) )); }
probe() {  # name variants tokens seconds
  timeout $(( $4 < $(left) ? $4 : $(left) )) python3 -u benchmarks/moe/mgpu_probe.py --variants "$2" --tokens $3 \
    --spans > $OUT/ab-$1.txt 2>&1
  echo "== $1 rc=$? at $(( $(date +%s) - start )) s"
  # T, variant, us, % of the floor, error (ERROR rows: the variant failed)
  grep SUMMARY $OUT/ab-$1.txt | grep -v triton \
    | awk '{e=""; for(i=1;i<=NF;i++) if($i=="err") e=$(i+1); print $2, $4, $5, $7, "err", e}'
}
probe t1-a "$V1" 1,2,4,7 200
probe t8-a "$V8" 8 120
if [ $(left) -gt 300 ]; then probe t1-b "$V1" 1,2 100; fi
echo "== tests at $(( $(date +%s) - start )) s"
timeout $(left) python3 -m pytest tests/pallas_kernels/test_nvfp4_fused_moe.py -m gpu -q -x \
  -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$? $(tail -1 $OUT/tests.log) at $(( $(date +%s) - start )) s"
grep -E "FAILED|Error" $OUT/tests.log | head -5 | cut -c1-300
