#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
# GPULENS_TEST_LANES=4 runs the suite as four lanes side by side, one pytest-xdist worker each
# (tests/lanes.py). The default is still one process, one test at a time: side by side at load 8-9,
# tests/agent/test_iterations_torch.py saw Kineto collect 17 optimizer steps for 5 (BENCHMARKS.md,
# "The suite's lanes"), and a failure seen once is a bug to fix before the lanes become the default.
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
bash scripts/setup.sh
bash image/setup.sh       # podman, runc, mmdebstrap: tests/container builds the image (image/build.sh)
echo "[test] set-up took $((SECONDS - t0)) s" >&2
lanes=${GPULENS_TEST_LANES:-0}
if [ "$lanes" = 0 ]; then
  exec .venv/bin/python -m pytest -p no:xdist "$@"
fi
exec .venv/bin/python -m pytest -n "$lanes" "$@"
