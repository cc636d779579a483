#!/usr/bin/env bash
# Set up (idempotent) and run the embedded default: `gpulens up`. Extra arguments go to it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/gpulens up "$@"
