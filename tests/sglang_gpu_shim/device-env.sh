# On the lent GPU (sourced, from the repo root, with carry [".sgl"]): installs what carry-wheels.sh
# built into /tmp/site and puts it, this stand-in and the repo on PYTHONPATH. SGLang then starts
# through rltrain's launcher with engine.extra_args=[--attention-backend, triton,
# --sampling-backend, pytorch, --disable-cuda-graph, --disable-radix-cache] (see README.md).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .sgl/*.whl >/dev/null 2>&1
tar -xJf .sgl/sglang-trim.tar.xz -C /tmp/site
export PYTHONPATH=/tmp/site:$PWD/tests/sglang_gpu_shim:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
