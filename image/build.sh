#!/usr/bin/env bash
# Build the gpulens image from the repository's Dockerfile, on a machine with no registry.
#   image/build.sh            -> prints the image name (localhost/gpulens:<version>) on stdout
# 1. installs podman/runc/mmdebstrap if missing (image/setup.sh);
# 2. makes the Dockerfile's base (FROM docker.io/library/debian:bookworm-slim) from Debian's
#    packages with mmdebstrap and imports it under that name, unless an image of that name exists;
# 3. builds the Dockerfile as is with podman (image/podman: runc, cgroupfs, no rlimit raising),
#    mounting the host's CA bundle into RUN steps only (the proxy's CA; nothing of it is in the
#    image), unless the image already carries the hash of exactly this build context.
# Progress and timings go to stderr, one line per step.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
# One build at a time on this machine (the test lanes, two clones): a second waits here, then finds
# the image its context hash names already built.
exec 9>"${TMPDIR:-/tmp}/gpulens-image-build.lock"
flock 9
say() { printf '[image] %s\n' "$*" >&2; }
t0=$(date +%s.%N)
elapsed() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$1" "$(date +%s.%N)"; }
bash image/setup.sh
P=$ROOT/image/podman

VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
NAME=${GPULENS_IMAGE_NAME:-localhost/gpulens}:$VERSION
BASE=docker.io/library/debian:bookworm-slim
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

if ! "$P" image exists "$BASE"; then
  tb=$(date +%s.%N)
  say "making $BASE with mmdebstrap (bookworm minbase, Debian's slim dpkg excludes)"
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  mmdebstrap --variant=minbase --include=ca-certificates --quiet \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/lintian/*' \
    bookworm "$tmp/base.tar" \
    "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" "deb $SECURITY bookworm-security main" >&2
  "$P" import --change 'CMD ["bash"]' --change 'LABEL gpulens.base=mmdebstrap' "$tmp/base.tar" "$BASE" >/dev/null
  say "base image ready in $(elapsed "$tb") s"
fi

# The build context as the Dockerfile sees it (.dockerignore: package sources, pyproject, README,
# the lock), plus the base image's id: equal hash, equal image.
context_hash=$( { "$P" image inspect --format '{{.Id}}' "$BASE";
  find Dockerfile .dockerignore pyproject.toml setup.py README.md image/requirements.txt \
    gpulens exporter capture alertrules dashboards hooks \
    -type f ! -name '*.pyc' ! -name '*.so' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' -print0 \
    | sort -z | xargs -0 sha256sum; } | sha256sum | cut -c1-16)
have=$("$P" image inspect --format '{{index .Labels "dev.gpulens.context"}}' "$NAME" 2>/dev/null || true)
if [ "$have" = "$context_hash" ]; then
  say "$NAME is up to date (context $context_hash)"
else
  tb=$(date +%s.%N)
  say "building $NAME from Dockerfile (context $context_hash)"
  ca=()
  [ -r /etc/ssl/certs/ca-certificates.crt ] && ca=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)
  "$P" build --pull=never --layers "${ca[@]}" --build-arg VERSION="$VERSION" \
    --label dev.gpulens.context="$context_hash" -t "$NAME" -f Dockerfile . >&2
  say "built in $(elapsed "$tb") s"
fi
size=$("$P" image inspect --format '{{.Size}}' "$NAME")
say "$NAME: $((size / 1000000)) MB, total $(elapsed "$t0") s"
echo "$NAME"
