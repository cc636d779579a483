#!/usr/bin/env bash
# Image build times and size: bench/image_build.sh [--source-change] [--cold]
#   default          warm: image/build.sh with nothing changed (context-hash hit), 5 runs
#   --source-change  a rebuild after one package file changes (podman layer cache below it), 1 run
#   --cold           removes the image and the mmdebstrap base first (a fresh machine's build), 1 run
# Prints one line per run and the image size; build.sh's own per-step timings go to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
P=image/podman
t() { local s e; s=$(date +%s.%N); image/build.sh >/dev/null; e=$(date +%s.%N); python3 -c "print(f'{$e-$s:.1f}')"; }
case "${1:-}" in
  --cold)
    name=$(image/build.sh 2>/dev/null)
    $P rmi -f "$name" docker.io/library/debian:bookworm-slim >/dev/null 2>&1 || true
    $P image prune -f >/dev/null 2>&1 || true
    echo "cold: $(t) s";;
  --source-change)
    f=gpulens/__init__.py; cp "$f" /tmp/.bench-image-keep; echo "# bench $(date +%s%N)" >> "$f"
    trap 'cp /tmp/.bench-image-keep gpulens/__init__.py' EXIT
    echo "source change: $(t) s";;
  *)
    image/build.sh >/dev/null 2>&1
    for i in 1 2 3 4 5; do echo "warm: $(t) s"; done;;
esac
name=$(image/build.sh 2>/dev/null)
echo "size: $($P image inspect --format '{{.Size}}' "$name" | python3 -c 'import sys; print(f"{int(sys.stdin.read())/1e6:.0f} MB")')"
