#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
# The suite runs as four lanes side by side, one pytest-xdist worker each (tests/lanes.py):
# GPULENS_TEST_LANES=0 runs it in one process, one test at a time, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
bash scripts/setup.sh
bash image/setup.sh       # podman, runc, mmdebstrap: tests/container builds the image (image/build.sh)
echo "[test] set-up took $((SECONDS - t0)) s" >&2
lanes=${GPULENS_TEST_LANES:-4}
if [ "$lanes" = 0 ]; then
  exec .venv/bin/python -m pytest -p no:xdist "$@"
fi
exec .venv/bin/python -m pytest -n "$lanes" "$@"
