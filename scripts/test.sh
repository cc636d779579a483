#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
# The suite runs as four lanes side by side, one pytest-xdist worker each (tests/lanes.py): about
# 34 minutes on 2 cores where one test at a time takes about 82 (BENCHMARKS.md, "The suite's
# lanes"). GPULENS_TEST_LANES=0 runs one test at a time, in one process (GPULENS_TEST_LANES=N: N lanes).
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
