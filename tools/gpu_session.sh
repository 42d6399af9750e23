#!/usr/bin/env bash
# One step of a GPU session on the offline GPU host (docs/vllm.md, "Running vLLM on an offline GPU host"): the
# bundles carried in .devcarry/ are stashed (vLLM's parts arrive over several calls) and unpacked once complete;
# weightcache runs from src/ (and is installed beside vLLM for its plugin entry point). Results go to $OUT.
#   tools/gpu_session.sh tests FILE...          the `gpu` tests of these files
#   tools/gpu_session.sh first-load ARGS...     bench/first_load.py ARGS
#   tools/gpu_session.sh verify                 bench/verify.py
#   tools/gpu_session.sh hash [ARGS]            bench/hash.py on this machine's cores
#   tools/gpu_session.sh vllm-tests ARGS...     the vLLM GPU tests (needs every vLLM part; -n 8 runs 8 at once)
#   tools/gpu_session.sh vllm-restart ARGS...   bench/vllm_restart.py ARGS (needs every vLLM part)
#   tools/gpu_session.sh engine-imports MODEL   bench/engine_imports.py: what vLLM's engine imports beyond the warm ones
#   tools/gpu_session.sh checkpoint NAME [DIR]  bench/restart.py's checkpoint NAME (8b, 32b, 30b-a3b, 24gb, ...) in DIR
#   tools/gpu_session.sh check                  versions, GPU, /dev/shm
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_HOST_IP=127.0.0.1 VLLM_USE_FLASHINFER_SAMPLER=0
for b in wcdeps loaders; do  # small bundles: every call carries them, unpacked once per machine
  if [ -e ".devcarry/$b/p01/manifest.json" ] && [ ! -d "/tmp/site-$b" ]; then
    python3 tools/offline_unpack.py --stash "/tmp/stash-$b" ".devcarry/$b"/p* >/dev/null \
      && python3 tools/offline_unpack.py --stash "/tmp/stash-$b" --extract "/tmp/site-$b" >/dev/null
  fi
done
for part in .devcarry/vllm026/p*; do  # vLLM's parts, one or two per call
  [ -e "$part/manifest.json" ] && python3 tools/offline_unpack.py --stash /tmp/stash-vllm "$part" >/dev/null
done
if [ ! -d /tmp/site-vllm ] && python3 tools/offline_unpack.py --stash /tmp/stash-vllm --extract /tmp/site-vllm \
    >/dev/null 2>&1; then
  echo "vLLM bundle unpacked"
fi
SITE=""
for s in /tmp/site-vllm /tmp/site-wcdeps /tmp/site-loaders; do [ -d "$s" ] && SITE="$SITE:$s"; done
export PYTHONPATH="$PWD/src$SITE"
if [ -d /tmp/site-vllm ] && [ ! -d /tmp/site-vllm/weightcache-0.1.0.dist-info ]; then
  # vLLM finds the plugin through its entry point: metadata only, the code is src/ (first on the path)
  mkdir -p /tmp/site-vllm/weightcache-0.1.0.dist-info
  printf 'Metadata-Version: 2.1\nName: weightcache\nVersion: 0.1.0\n' > /tmp/site-vllm/weightcache-0.1.0.dist-info/METADATA
  printf '[vllm.general_plugins]\nweightcache = weightcache.integrations.vllm.plugin:register\n' \
    > /tmp/site-vllm/weightcache-0.1.0.dist-info/entry_points.txt
fi
what=${1:-check}; shift || true
case "$what" in
  check)
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
    df -h /dev/shm | tail -1; nproc; free -g | head -2
    python3 -c "import torch, weightcache, blake3, msgspec; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    python3 -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: not yet"
    ;;
  tests)
    python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu "$@" 2>&1 | tee -a "$OUT/gpu-tests.log" | tail -40
    ;;
  first-load)
    python3 bench/first_load.py "$@" 2>&1 | tee -a "$OUT/first-load.log" | tail -40
    cp bench/results/first-load-*.json "$OUT/" 2>/dev/null
    ;;
  verify)
    python3 bench/verify.py --out "$OUT/verify.json" 2>&1 | tee "$OUT/verify.log" | tail -30
    ;;
  hash)
    [ $# -gt 0 ] || set -- --files 4 --file-mb 2048 --threads 1 4 8 16
    python3 bench/hash.py --out "$OUT/hash.json" "$@" 2>&1 \
      | tee "$OUT/hash.log" | tail -20
    ;;
  vllm-tests)  # one line per test as it ends (-v), so that a run cut short by its time limit still says which passed
    python3 -m pytest -v -rfEP -p no:cacheprovider -m "gpu and vllm" "$@" 2>&1 | tee -a "$OUT/vllm-gpu-tests.log" \
      | grep -E "PASSED|FAILED|ERROR|QUANT|passed|failed|^E " | tail -60
    ;;
  vllm-restart)
    python3 bench/vllm_restart.py --out "$OUT/vllm-restart.json" "$@" 2>&1 | tee -a "$OUT/vllm-restart.log" | tail -40
    ;;
  engine-imports)
    python3 bench/engine_imports.py discover --model "$1" --out "$OUT/engine-imports.json" 2>&1 | tail -3
    python3 bench/engine_imports.py time --list "$OUT/engine-imports.json" --out "$OUT/engine-imports-time.json" 2>&1 \
      | tee "$OUT/engine-imports.log" | tail -30
    ;;
  checkpoint)  # written once per machine (a stamp says so); prints its path
    python3 -c 'import sys; sys.path.insert(0, "bench"); from pathlib import Path; import torch, restart
print(restart.ensure_checkpoint(Path(sys.argv[2]), sys.argv[1], torch.bfloat16)[0])' "$1" "${2:-/dev/shm/wcck}"
    ;;
  *) echo "unknown step: $what"; exit 2 ;;
esac
