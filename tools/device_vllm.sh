#!/usr/bin/env bash
# On the offline GPU host, after the vLLM bundle is extracted to $SITE (tools/offline_unpack.py):
# install weightcache next to it (its vLLM plugin entry point must be visible), then run what is asked.
#   tools/device_vllm.sh check          versions, GPU, /dev/shm
#   tools/device_vllm.sh tests [ARGS]   the vLLM GPU tests (tests/test_vllm_gpu.py): side by side in JOBS (6)
#                                       pytest-xdist workers where xdist is there, then the KV-capacity test alone
#   tools/device_vllm.sh gpu-tests      every other `gpu` test (arena, sources, engines, custodian, supervisor)
#   tools/device_vllm.sh custodian M    bench/custodian.py --models M (fresh load vs preload restart vs replacement)
#   tools/device_vllm.sh restart M..    bench/restart.py --models M.. (transformers: disk vs attach vs CUDA IPC)
#   tools/device_vllm.sh hold GB        bench/vllm_hold.py (a rank at 1x)
#   tools/device_vllm.sh startup GB [--eager]  bench/vllm_startup.py (disk vs attach, RUNS=3 runs)
set -uo pipefail
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# FlashInfer is not staged: vLLM 0.26's sampler would import it unless told not to.
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_HOST_IP=127.0.0.1 \
  VLLM_USE_FLASHINFER_SAMPLER=0
# weightcache's own dependencies as wheels in .whl/ (msgspec, fastapi, ...), for runs without the vLLM bundle
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
fi
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
    # the machine's own packages: without the staged bundle on the path (a freeze with it would hide the bundle's)
    env -u PYTHONPATH python3 -m pip list --format=freeze 2>/dev/null > "$OUT/gpu-freeze.txt"
    ;;
  tests)
    par=()
    if python3 -c "import xdist" 2>/dev/null; then par=(-n "${JOBS:-6}" --dist loadgroup); fi
    t0=$SECONDS
    python3 -m pytest -q -rfEsp -p no:cacheprovider -m "gpu and vllm" tests/test_vllm_gpu.py "${par[@]}" \
      -k "not kv_cache" "$@" 2>&1 | tee "$OUT/vllm-gpu-tests.log"
    echo "side by side: $((SECONDS - t0)) s" | tee -a "$OUT/vllm-gpu-tests.log"
    python3 -m pytest -q -rfEsp -s -p no:cacheprovider -m "gpu and vllm" tests/test_vllm_gpu.py -k kv_cache "$@" 2>&1 \
      | tee -a "$OUT/vllm-gpu-tests.log"
    echo "in all: $((SECONDS - t0)) s" | tee -a "$OUT/vllm-gpu-tests.log"
    ;;
  gpu-tests)
    python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests --ignore=tests/test_vllm_gpu.py --ignore=tests/test_vllm_quant_gpu.py "$@" 2>&1 \
      | tee "$OUT/gpu-tests.log"
    ;;
  custodian)
    python3 bench/custodian.py --models "${1:-8b}" --runs "${RUNS:-3}" --ckpt-dir /dev/shm/wcb --out bench/results/custodian-h200.json 2>&1 \
      | tee "$OUT/custodian-h200.log"
    cp bench/results/custodian-h200.json "$OUT/" 2>/dev/null
    ;;
  restart)
    # rows merge into bench/results/restart-h200.json (other models' rows are kept)
    python3 bench/restart.py --models "$@" --runs "${RUNS:-3}" --ckpt-dir /dev/shm/wcb --no-plot --out bench/results/restart-h200.json \
      ${ENGINES:+--engines $ENGINES} 2>&1 | tee "$OUT/restart-h200.log"
    cp bench/results/restart-h200.json bench/results/restart-h200.md "$OUT/" 2>/dev/null
    ;;
  hold)
    python3 bench/vllm_hold.py --gb "${1:-85}" --workdir /dev/shm/wchold 2>&1 | tee "$OUT/vllm-hold.log"
    cp bench/results/vllm-hold-*.json /dev/shm/wchold/preload.log "$OUT/" 2>/dev/null; rm -rf /dev/shm/wchold
    ;;
  startup)
    python3 bench/vllm_startup.py --runs "${RUNS:-3}" --big-gb "${1:-16}" --no-tiny --workdir /dev/shm/wcvb "${@:2}" 2>&1 | tee "$OUT/vllm-startup.log"
    cp bench/results/vllm-startup-*.json "$OUT/" 2>/dev/null; rm -rf /dev/shm/wcvb
    ;;
  *) echo "unknown: $what"; exit 2 ;;
esac
