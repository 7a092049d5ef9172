export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 -m pip install -q --no-index --no-deps .wheels/*.whl 2>&1 | grep -v WARNING | tail -1
ln -sfn ../kernels rltrain/kernels   # the checkout is not installed here: pyproject maps kernels/ to rltrain.kernels
RLTRAIN_SKIP_SGLANG=1 timeout 150 python3 -m pytest -q tests/test_kernels.py -p no:cacheprovider 2>&1 | grep -E "Error|error:|passed|failed" | tail -12 | tee $OUT/test_kernels.txt
