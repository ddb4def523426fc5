#!/usr/bin/env bash
# The peers of bench/engines_h200.py on a GPU machine with no network, from files fetched beforehand.
#
# Where PyPI is reachable (any x86-64 machine), into the repository's .whl/ and .gg/ (both ignored):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl/peers \
#     ai2-olmo-core==3.0.0 torchtitan==0.2.2 <their requirements the GPU image lacks: cached-path,
#     dataclass-extensions, bettermap, importlib-resources, boto3, botocore, s3transfer, jmespath,
#     google-cloud-storage and its google-* / proto-plus / pyasn1 / opentelemetry-api requirements,
#     cryptography, cffi, pycparser, datasets, dill, multiprocess, torchdata, tomli, tyro,
#     docstring-parser, typeguard>
#   pydantic, pydantic-core, annotated-types, typing-inspection, tomlkit the same way into .whl/base
#   the grouped_gemm sdist (source only: its CUDA extension compiles against the installed torch)
#   from https://pypi.org/project/grouped_gemm/0.3.0/ into .gg/
#
# Then, on the GPU machine, in the repository root:
#   source bench/peers_setup.sh            # installs the wheels and starts the grouped_gemm build
#   python3 bench/engines_h200.py --only torch,torch_layout ...
#   python3 bench/engines_h200.py --only torch,olmo-core_v1_dropless ...   # waits for the build
#
# grouped_gemm is built the way OLMo-core's own image builds it (its src/Dockerfile:
# TORCH_CUDA_ARCH_LIST="9.0 10.0" GROUPED_GEMM_CUTLASS=1 pip install grouped_gemm: the CUTLASS
# grouped kernel, which takes the batch sizes on the GPU as OLMo-core passes them; the default
# cuBLAS build refuses them), for the machine's compute capability (9.0 on Hopper), in place;
# PYTHONPATH then finds it.
SITE=${SITE:-/tmp/site}
GG_DIR=${GG_DIR:-/tmp/gg}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
  .whl/base/*.whl .whl/peers/*.whl || return 1 2>/dev/null || exit 1
mkdir -p "$GG_DIR" && tar xzf .gg/grouped_gemm-*.tar.gz -C "$GG_DIR"
GG_SRC=$(ls -d "$GG_DIR"/grouped_gemm-*/ | head -1)
export PYTHONPATH="$SITE:$GG_SRC:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# bench/peers.py waits for $GG_DONE (the build's exit status) before it imports grouped_gemm
export GG_DONE="$GG_DIR/done"
rm -f "$GG_DONE"
( cd "$GG_SRC" && GROUPED_GEMM_CUTLASS=${GROUPED_GEMM_CUTLASS:-1} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-8} \
    timeout "${GG_TIMEOUT:-900}" python3 setup.py build_ext --inplace > "${GG_LOG:-/tmp/gg_build.log}" 2>&1;
  echo $? > "$GG_DONE.tmp" && mv "$GG_DONE.tmp" "$GG_DONE" ) &
