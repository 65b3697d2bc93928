#!/usr/bin/env bash
# The cuda device's checks on a GPU machine (issue 13), as one script for the device tool:
# installs pagedllm (editable, no dependencies: the machine has torch, triton and
# transformers) with the carried wheels of what it lacks (.whl, see the note),
# runs tests/kernels/test_cuda.py with Triton compiling (TESTS=none: not), then
# benchmarks/gpu_check.py (GPU_CHECK_SKIP: its steps to leave out).
# Everything it reports lands in $OUT (or ./gpu-out).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { cat "$OUT/install.log"; exit 1; }
python3 -m pip install -q --no-deps --no-build-isolation ./tests/plugins/dummy_plugin \
  >>"$OUT/install.log" 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
lscpu | grep 'Model name' | tee -a "$OUT/gpu.txt"
python3 -m pagedllm.entrypoints.cli.main collect-env >>"$OUT/gpu.txt" 2>&1
start=$(date +%s)
if [ "${TESTS:-tests/kernels/test_cuda.py}" != none ]; then
  timeout "${TEST_TIMEOUT:-210}" python3 -m pytest -q -p no:cacheprovider -o timeout=90 \
    ${TESTS:-tests/kernels/test_cuda.py} "$@" >"$OUT/pytest.txt" 2>&1
  tail -n 60 "$OUT/pytest.txt"
  echo "tests: $(( $(date +%s) - start )) s"
fi
timeout "${CHECK_TIMEOUT:-200}" python3 benchmarks/gpu_check.py --out "$OUT" \
  ${GPU_CHECK_SKIP:+--skip $GPU_CHECK_SKIP} >"$OUT/gpu_check.log" 2>&1
tail -n 80 "$OUT/gpu_check.log"
