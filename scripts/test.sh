#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash image/setup.sh       # podman, runc, mmdebstrap: tests/container builds the image (image/build.sh)
exec .venv/bin/python -m pytest "$@"
