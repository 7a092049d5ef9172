#!/bin/bash
# Builds .sgl/ (ignored by git; 54.5 MB, under the lent GPU's 64 MiB carry limit): real SGLang
# 0.5.23 for CPython 3.12 without its multimodal_gen/test/benchmark packages (xz, 20.9 MB; the
# wheel is 39 MB), and the pure-Python or small dependencies the GPU image lacks. Not carried:
# sglang-kernel, flashinfer, the CuTe DSL, deep_gemm (stood in for by this directory or unused
# with the flags below), and pycountry, airportsdata, jedi, mistral_common, tml_renderers,
# anthropic (not imported on the serving path). torch 2.11, triton 3.6 and transformers are the
# image's: SGLang pins torch 2.14.1 but its serving path for a dense model ran on 2.11.
#
#   tests/sglang_gpu_shim/carry-wheels.sh        (here, from the repo root)
#   then on the device, with carry [".sgl"]:     . tests/sglang_gpu_shim/device-env.sh
set -euo pipefail
mkdir -p .sgl /tmp/sgl-wheel
grep -qx "/.sgl/" .git/info/exclude || echo "/.sgl/" >> .git/info/exclude
PL=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform any)
for n in 17 24 26 27 28 31 34 35 39; do PL+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q "${PL[@]}" -d /tmp/sgl-wheel sglang==0.5.23
rm -rf /tmp/sgl-wheel/x && mkdir /tmp/sgl-wheel/x && (cd /tmp/sgl-wheel/x && unzip -q ../sglang-0.5.23-*.whl \
    && rm -rf sglang/multimodal_gen sglang/test sglang/benchmark \
    && tar -cf - sglang sglang-0.5.23.dist-info | xz -T0 -6 > "$OLDPWD/.sgl/sglang-trim.tar.xz")
python3 -m pip download -q "${PL[@]}" -d .sgl \
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 uvicorn==0.54.0 orjson==3.13.0 pyzmq==27.3.0 pybase64==1.5.1 \
    python-multipart==0.0.34 msgspec==0.23.0 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7 \
    interegular==0.3.3 llguidance==1.9.1 xgrammar==0.2.7 compressed-tensors==0.18.0 openai==2.8.0 \
    jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 blobfile==3.0.0 pycryptodomex==3.24.2 gguf==0.19.0 \
    easydict==1.14 openai-harmony==0.0.4 apache-tvm-ffi==0.1.11 watchfiles==1.3.0 outlines==0.1.11 \
    outlines_core==0.1.26 lark==1.3.1 diskcache==5.6.3 loguru==0.7.3 smg-grpc-servicer==0.14.1 \
    smg-grpc-proto==0.4.28 torch_memory_saver==0.0.10 soundfile==0.13.1 cffi==2.1.1 pycparser==3.12 \
    ipython==9.18.1 ipython_pygments_lexers==1.1.1 traitlets==5.16.1 parso==0.8.7 prompt_toolkit==3.0.53 \
    pexpect==4.9.0 ptyprocess==0.7.0 stack_data==0.6.3 executing==2.3.0 asttokens==3.0.2 pure_eval==0.2.4 \
    matplotlib-inline==0.2.2 decorator wcwidth==0.9.4 dill==0.4.1 docstring_parser==0.18.0 \
    grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 httpcore2==2.16.2 httpx2==2.16.2 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
    multiprocess==0.70.19 nest-asyncio==1.6.0 opentelemetry-api==1.45.2 pydantic-extra-types==2.11.1 \
    tomlkit==0.15.2 truststore==0.10.5 zstandard==0.25.0
du -sh .sgl
