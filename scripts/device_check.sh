#!/usr/bin/env bash
# The one prepared accelerator run (see scripts/device_check.py for what it measures): JSON and log
# into $OUT (default /tmp/device_check_out), rewritten after every section.
#
#   scripts/device_check.sh           # on the GPU machine: at most about 5 minutes on one H200
#   scripts/device_check.sh --smoke   # any machine: CPU, tiny shapes, Pallas interpreted
#
# Extra arguments go to scripts/device_check.py (--help). Works from a plain checkout: the script
# imports jaxrunner (and kernels/ as jaxrunner.kernels) from it when the package is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/device_check_out}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
fi
"$PY" -c 'import jax, sys; print("python", sys.version.split()[0], "jax", jax.__version__, "devices", jax.devices(), flush=True)'
"$PY" scripts/device_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/device_check.log"
exit "${PIPESTATUS[0]}"
