. tests/sglang_gpu_shim/device-env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
cat /sys/kernel/mm/transparent_hugepage/enabled
git log --oneline -1
timeout 150 python3 -m rltrain.bench.hostcopy 2>&1 | tee $OUT/hostcopy.txt
timeout 100 python3 -m pytest -q -rA tests/test_gpu.py -k "kind_of_page_locked or budget or trainer_release" 2>&1 | tail -15 | tee $OUT/tests1.txt
timeout 300 python3 -m rltrain.bench.e2e --shape 1.7b --steps 4 --prompts 64 --n 8 --max-new-tokens 256 --micro 16 --compile --keep /tmp/e2e --offload auto 2>&1 | tail -80 | tee $OUT/e2e_auto.txt
