#!/usr/bin/env bash
# On the offline GPU host, after the vLLM bundle is extracted to $SITE (tools/offline_unpack.py):
# install weightcache next to it (its vLLM plugin entry point must be visible), then run what is asked.
#   tools/device_vllm.sh check          versions, GPU, /dev/shm
#   tools/device_vllm.sh tests [-k EXPR] the vLLM GPU tests (tests/test_vllm_gpu.py) and the arena GPU tests
#   tools/device_vllm.sh hold GB        bench/vllm_hold.py (a rank at 1x)
#   tools/device_vllm.sh startup GB     bench/vllm_startup.py (disk vs attach, 3 runs)
set -uo pipefail
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# FlashInfer is not staged: vLLM 0.26's sampler would import it unless told not to.
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_HOST_IP=127.0.0.1 \
  VLLM_USE_FLASHINFER_SAMPLER=0
if ! python3 -c "import weightcache" 2>/dev/null || [ "${REINSTALL:-1}" = 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target "$SITE" . >/dev/null 2>&1 \
    || { echo "weightcache install failed"; exit 1; }
fi
what=${1:-check}; shift || true
case "$what" in
  check)
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    df -h /dev/shm | tail -1
    python3 -c "import torch, vllm, transformers, weightcache; print('torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__)"
    python3 -m pip list --format=freeze 2>/dev/null > "$OUT/gpu-freeze.txt"
    ;;
  tests)
    python3 -m pytest -q -rA -p no:cacheprovider -m "gpu and vllm" tests/test_vllm_gpu.py "$@" 2>&1 | tee "$OUT/vllm-gpu-tests.log"
    ;;
  hold)
    python3 bench/vllm_hold.py --gb "${1:-85}" --workdir /dev/shm/wchold 2>&1 | tee "$OUT/vllm-hold.log"
    cp bench/results/vllm-hold-*.json "$OUT/" 2>/dev/null; rm -rf /dev/shm/wchold
    ;;
  startup)
    python3 bench/vllm_startup.py --runs 3 --big-gb "${1:-16}" --no-tiny --workdir /dev/shm/wcvb 2>&1 | tee "$OUT/vllm-startup.log"
    cp bench/results/vllm-startup-*.json "$OUT/" 2>/dev/null; rm -rf /dev/shm/wcvb
    ;;
  *) echo "unknown: $what"; exit 2 ;;
esac
