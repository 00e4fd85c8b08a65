#!/usr/bin/env bash
# The one-launch NVFP4 layer with its pairs added in the kernel (`fused_decode_moe(pair_sum=True)`) against the
# default (XLA adds them after the kernel), counters passed as the model passes them, in two processes (A B, then
# B A), then the kernel's GPU tests; one device call of ~560 s:
#     OUT=dir bash benchmarks/moe/pair_sum_ab.sh
set -u
mkdir -p $OUT
start=$(date +%s)
C='"counters_passed": true'
AB="[{$C}, {$C, \"fused_settings\": {\"pair_sum\": true}}]"
BA="[{$C, \"fused_settings\": {\"pair_sum\": true}}, {$C}]"
left() { echo $(( 560 - ($(date +%s) - start) )); }
probe() {  # name variants tokens seconds
  timeout $(( $4 < $(left) ? $4 : $(left) )) python3 -u benchmarks/moe/mgpu_probe.py --variants "$2" --tokens $3 \
    --spans > $OUT/ab-$1.txt 2>&1
  echo "== $1 rc=$? at $(( $(date +%s) - start )) s"
  # T, variant, us, % of the floor, error (ERROR: the variant failed)
  grep ^PROGRESS $OUT/ab-$1.txt | grep -v triton | cut -d' ' -f2- | cut -c1-200
}
probe ab "$AB" 1,2,4,7 90
probe ba "$BA" 1,2,4,7 90
echo "== tests at $(( $(date +%s) - start )) s"
timeout $(left) python3 -m pytest tests/pallas_kernels/test_nvfp4_fused_moe.py -m gpu -q -x \
  -p no:cacheprovider > $OUT/tests.log 2>&1
echo "tests rc=$? $(tail -1 $OUT/tests.log) at $(( $(date +%s) - start )) s"
grep -E "FAILED|Error" $OUT/tests.log | head -5 | cut -c1-300
