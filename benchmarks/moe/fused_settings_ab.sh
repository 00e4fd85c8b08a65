#!/usr/bin/env bash
# The one-launch NVFP4 layer's untimed settings (RESULTS.md, "Session 41 note" and "Session 42 note"; each passed
# its interpret-mode tests on the CPU, none has run on a GPU), in one device call of ~560 s:
# spans with counters passed (each row with its error against the reference), then the kernel's GPU tests.
#     OUT=dir bash benchmarks/moe/fused_settings_ab.sh
# The probe prints a PROGRESS line as each variant is timed, so a process cut short (a hang: this kernel's waits
# spin) still shows what ran before; the per-step waits, the newest synchronization, run in processes of their own.
set -u
mkdir -p $OUT
start=$(date +%s)
C='"counters_passed": true'
V1="[{$C}, {$C, \"fused_settings\": {\"down_lag\": 1}},
 {$C, \"fused_settings\": {\"down_lag\": 1, \"smem_pad\": 16384}},
 {$C, \"fused_settings\": {\"down_lag\": 1, \"smem_pad\": 40960}},
 {$C, \"fused_settings\": {\"smem_pad\": 16384}}]"
V8="[{$C}, {$C, \"fused\": true}, {$C, \"fused\": true, \"fused_settings\": {\"down_lag\": 1}},
 {$C, \"fused\": true, \"fused_settings\": {\"down_lag\": 4}},
 {$C, \"fused\": true, \"fused_settings\": {\"down_lag\": 1, \"smem_pad\": 24576}},
 {$C, \"fused\": true, \"fused_settings\": {\"dedup_experts\": true}},
 {$C, \"fused\": true, \"fused_settings\": {\"dedup_experts\": true, \"down_lag\": 1}}]"
DEDUP="[{$C}, {$C, \"fused_settings\": {\"dedup_experts\": true}}]"
STEPS="[{$C}, {$C, \"fused_settings\": {\"down_step_waits\": true}},
 {$C, \"fused_settings\": {\"down_step_waits\": true, \"down_lag\": 1}}]"
STEPS8="[{$C, \"fused\": true}, {$C, \"fused\": true,
 \"fused_settings\": {\"down_overlap\": true, \"down_step_waits\": true, \"down_lag\": 1}}]"
left() { echo $(( 560 - ($(date +%s) - start) )); }
probe() {  # name variants tokens seconds
  timeout $(( $4 < $(left) ? $4 : $(left) )) python3 -u benchmarks/moe/mgpu_probe.py --variants "$2" --tokens $3 \
    --spans > $OUT/ab-$1.txt 2>&1
  echo "== $1 rc=$? at $(( $(date +%s) - start )) s"
  # T, variant, us, % of the floor, error (ERROR: the variant failed)
  grep ^PROGRESS $OUT/ab-$1.txt | grep -v triton | cut -d' ' -f2- | cut -c1-200
}
probe t1-a "$V1" 1,2,4,7 130
probe t8-a "$V8" 8 130
probe steps "$STEPS" 1,2 80
probe steps8 "$STEPS8" 8 50
probe dedup "$DEDUP" 4,7 70
if [ $(left) -gt 260 ]; then probe t1-b "$V1" 1,2 80; fi
echo "== tests at $(( $(date +%s) - start )) s"
timeout $(left) python3 -m pytest tests/pallas_kernels/test_nvfp4_fused_moe.py -m gpu -q -x \
  -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$? $(tail -1 $OUT/tests.log) at $(( $(date +%s) - start )) s"
grep -E "FAILED|Error" $OUT/tests.log | head -5 | cut -c1-300
