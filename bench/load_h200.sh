#!/usr/bin/env bash
# The GPU load benchmark in one command (docs/benchmarks.md): the GPU tests of the checkpoint source, then
# bench/load.py with the option sweep and the cold rows. The optional readers' wheels in .whl/ or .devcarry/
# (InstantTensor, fastsafetensors), and the bundles in .devcarry/ (`make stage-loaders stage-deps`), are unpacked into
# a temporary directory: no network needed, nothing installed.
# Smaller or larger: SIZE_GB (16), COLD_GB (4), RUNS (2), SWEEP (h200), COLD_DIR (/tmp/wccold), TESTS (1),
# TEST_FILES (tests/test_safetensors_source.py), PROBE_RUNS (0: rounds of bench/native_probe.py afterwards).
# Results: $OUT (else bench/results)/load-h200.json, load-h200.log, load-h200-gpu-tests.log.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
outdir=${OUT:-bench/results}
mkdir -p "$outdir"
extra=$(mktemp -d)
for w in .whl/*.whl .devcarry/*.whl; do
  if [ -e "$w" ]; then "$py" -m zipfile -e "$w" "$extra"; fi
done
sites=$extra
for bundle in .devcarry/*/; do  # bundles staged by `make stage-loaders` / `make stage-deps`, one site each
  [ -e "${bundle}p01/manifest.json" ] || continue
  name=$(basename "$bundle")
  "$py" tools/offline_unpack.py --stash "$extra/stash-$name" "$bundle"p* >/dev/null
  "$py" tools/offline_unpack.py --stash "$extra/stash-$name" --extract "$extra/site-$name" >/dev/null
  sites="$sites:$extra/site-$name"
done
export PYTHONPATH="$sites:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
"$py" - <<'PY'
import importlib, torch
print("torch", torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "(no CUDA)")
for m in ("instanttensor", "fastsafetensors", "cuda.bindings"):
    try:
        importlib.import_module(m)
        print(m, "importable")
    except Exception as e:
        print(m, "NOT importable:", type(e).__name__, e)
PY
if [ "${TESTS:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  ("$py" -m pytest -q -p no:cacheprovider -m gpu ${TEST_FILES:-tests/test_safetensors_source.py} 2>&1 || true) | tail -8 \
    | tee "$outdir/load-h200-gpu-tests.log"  # a failing test is in the log; the benchmark still runs
fi
cleanup=--cleanup
if [ "${PROBE_RUNS:-0}" -gt 0 ]; then cleanup=; fi  # the probe reads the same checkpoint, then removes it
"$py" bench/load.py --dir /dev/shm/wcload --size-gb "${SIZE_GB:-16}" --cold-dir "${COLD_DIR:-/tmp/wccold}" \
  --cold-gb "${COLD_GB:-4}" --runs "${RUNS:-2}" --sweep "${SWEEP:-h200}" --rewrite $cleanup \
  --out "$outdir/load-h200.json" 2>&1 | tee "$outdir/load-h200.log"
if [ "${PROBE_RUNS:-0}" -gt 0 ]; then
  "$py" bench/native_probe.py --dir /dev/shm/wcload --size-gb "${SIZE_GB:-16}" --runs "$PROBE_RUNS" \
    --out "$outdir/native-probe-h200.json" 2>&1 | tee "$outdir/native-probe-h200.log"
  rm -rf /dev/shm/wcload "${COLD_DIR:-/tmp/wccold}"
fi
rm -rf "$extra"
