#!/usr/bin/env bash
# Idempotent: the Debian packages image/build.sh and the container tests need (podman, runc,
# mmdebstrap). scripts/test.sh runs it; image/build.sh runs it too. One line per step on stderr.
set -euo pipefail
say() { printf '[image-setup] %s\n' "$*" >&2; }
PKGS=(podman runc mmdebstrap containernetworking-plugins iptables)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]})) || exit 0
if [ "$(id -u)" != 0 ]; then
  say "missing Debian packages (${missing[*]}) and not root: install them, then re-run"; exit 1
fi
say "installing Debian packages: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "${missing[@]}" >&2 \
  || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; }
