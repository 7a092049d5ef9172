. tests/sglang_gpu_shim/device-env.sh
git log --oneline -1; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 80 python3 -m rltrain.bench.hostcopy --kinds register 2>&1 | tee $OUT/hostcopy.txt
timeout 45 python3 -m pytest -q -rA tests/test_gpu.py -k "kind_of_page_locked or budget or trainer_release or separate_allocations" 2>&1 | grep -E "PASS|FAIL|Error|passed|failed" | tee $OUT/tests.txt
E="python3 -m rltrain.bench.e2e --shape 1.7b --steps 4 --prompts 64 --n 8 --max-new-tokens 256 --micro 16 --compile --keep /tmp/e2e"
timeout 230 $E --offload auto 2>&1 | tail -60 | tee $OUT/e2e_auto.txt
timeout 165 $E --offload fit 2>&1 | tail -60 | tee $OUT/e2e_fit.txt
timeout 40 $E --offload auto fit --report-only 2>&1 | tail -100 > $OUT/e2e_report.txt
