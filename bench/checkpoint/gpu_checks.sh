#!/usr/bin/env bash
# The GPU checks in one run, for a lent GPU machine (its own python3 with a CUDA torch):
# the CUDA tests, then bench/checkpoint/gpu.py. Wheels the image lacks (obstore, crc32c)
# travel in .whl/ (see docs/benchmarks.md, "On a GPU"). Logs and the JSON go to $OUT.
#
#   bash bench/checkpoint/gpu_checks.sh [PARAMS_GB [ROWS]]   (ROWS: gpu.py's --rows)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:src
else
  export PYTHONPATH=src
fi
{
  nvidia-smi -L
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  df -h /dev/shm | tail -1
  nproc; free -g | head -2
} 2>&1 | tee "$OUT/machine.txt"
python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout 300 \
  tests/checkpoint/test_cuda.py tests/checkpoint/staging/test_verify.py \
  tests/checkpoint/test_memory_tier.py "tests/checkpoint/staging/test_stager.py::test_cuda_sources_are_compared_after_the_copy" \
  2>&1 | tee "$OUT/tests.log" | tail -25
python3 -m bench.checkpoint.gpu --params-gb "${1:-1}" --saves 3 --interval 3 \
  --rows "${2:-torch_save,dcp_save,dcp_async,dcp_async_pinned,unbroken}" \
  2>&1 | tee "$OUT/bench.log" | grep -v " INFO " | tail -40
