#!/usr/bin/env bash
# Second of two device calls: join the carried mlx-cuda-13 wheel pieces,
# install mlx + mlx-lm into /tmp/site, then run the benchmark given as "$@".
# (The first call copied .whl/cuda.part.aa to /tmp/w; see docs/benchmarks.md.)
# The wheels, fetched here (the device's python3 is 3.12):
#   pip download --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 --python-version 3.12 \
#       mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 -d /tmp/wh
#   split -b 45M /tmp/wh/mlx_cuda_13-*.whl cuda.part.   # .aa into .whl/, .ab and the other two into .whl2/
set -euo pipefail
mkdir -p /tmp/w
cat /tmp/w/cuda.part.aa .whl2/cuda.part.ab > /tmp/w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
cp .whl2/*.whl /tmp/w/
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl
# libmlx looks for the CUDA libraries beside itself.
NV=$(python3 -c "import nvidia, os; print(list(nvidia.__path__)[0])")
ln -sfn "$NV" /tmp/site/nvidia
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -c "import mlx.core as mx; print(mx.__version__, mx.default_device(), mx.device_info().get('device_name', ''))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$@"
