#!/usr/bin/env bash
# Accelerator check of jaxrunner's attention kernels: Pallas vs reference correctness, Pallas vs
# XLA decode timing with achieved bandwidth, JSON into $OUT (default /tmp/device_check_out).
#
#   scripts/device_check.sh                  # GPU machine: full check (~2-4 min incl. compiles)
#   scripts/device_check.sh --cpu-rehearsal  # any machine: tiny sizes, Pallas interpreted
#
# Extra arguments go to scripts/device_check.py (see --help). Works without installing the
# package: device_check.py imports kernels/ as jaxrunner.kernels straight from this checkout.
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-/tmp/device_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
"$PY" - <<'PYEOF'
import jax, sys
print("python", sys.version.split()[0], "jax", jax.__version__, "devices", jax.devices(), flush=True)
PYEOF
"$PY" scripts/device_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/device_check.log"
exit "${PIPESTATUS[0]}"
