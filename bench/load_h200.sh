#!/usr/bin/env bash
# The GPU load benchmark in one command (docs/benchmarks.md): the GPU tests of the checkpoint source, then
# bench/load.py with the option sweep and the cold rows. The optional readers' wheels in .whl/ (InstantTensor,
# fastsafetensors) are unpacked into a temporary directory: no network needed, nothing installed.
# Smaller or larger: SIZE_GB (16), COLD_GB (4), RUNS (2), SWEEP (h200), COLD_DIR (/tmp/wccold), TESTS (1).
# Results: $OUT (else bench/results)/load-h200.json, load-h200.log, load-h200-gpu-tests.log.
set -euo pipefail
cd "$(dirname "$0")/.."
outdir=${OUT:-bench/results}
mkdir -p "$outdir"
extra=$(mktemp -d)
for w in .whl/*.whl; do
  if [ -e "$w" ]; then python -m zipfile -e "$w" "$extra"; fi
done
export PYTHONPATH="$extra:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
python - <<'PY'
import importlib, torch
print("torch", torch.__version__, torch.cuda.get_device_name(0))
for m in ("instanttensor", "fastsafetensors", "cuda.bindings"):
    try:
        importlib.import_module(m)
        print(m, "importable")
    except Exception as e:
        print(m, "NOT importable:", type(e).__name__, e)
PY
if [ "${TESTS:-1}" = 1 ]; then
  python -m pytest -q -m gpu tests/test_safetensors_source.py 2>&1 | tail -8 | tee "$outdir/load-h200-gpu-tests.log"
fi
python bench/load.py --dir /dev/shm/wcload --size-gb "${SIZE_GB:-16}" --cold-dir "${COLD_DIR:-/tmp/wccold}" \
  --cold-gb "${COLD_GB:-4}" --runs "${RUNS:-2}" --sweep "${SWEEP:-h200}" --rewrite --cleanup \
  --out "$outdir/load-h200.json" 2>&1 | tee "$outdir/load-h200.log"
rm -rf "$extra"
