#!/usr/bin/env bash
# Build the five Kubernetes binaries the test cluster runs, from Debian 12's `kubernetes` source
# package (1.20.2: the newest Kubernetes buildable here, with no Go module proxy), with Debian's
# golang-1.19. Idempotent and cached by package version:
#   $GPULENS_CLUSTER_CACHE/k8s-<version>/bin/{kube-apiserver,kube-controller-manager,kube-scheduler,kubelet,kube-proxy}
# The cache defaults to /var/cache/gpulens-cluster (outside the clone, so a fresh clone on the same
# machine reuses it); the cold path (download, patch, compile) takes ~6-10 min on 2 cores.
# /etc/apt is never touched: the deb-src list and package lists live in the cache.
set -euo pipefail
say() { printf '[cluster-build] %s\n' "$*" >&2; }
CACHE=${GPULENS_CLUSTER_CACHE:-/var/cache/gpulens-cluster}
PKG=kubernetes
WHAT=(kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy)
mkdir -p "$CACHE/apt/lists/partial" "$CACHE/src"

aptsrc=(-o Dir::Etc::SourceList="$CACHE/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
        -o Dir::State::Lists="$CACHE/apt/lists" -o Dir::Cache="$CACHE/apt/cache")
echo "deb-src http://deb.debian.org/debian bookworm main" > "$CACHE/apt/sources.list"
echo "deb-src http://deb.debian.org/debian-security bookworm-security main" >> "$CACHE/apt/sources.list"
mkdir -p "$CACHE/apt/cache/archives/partial"

ver_file="$CACHE/src/version"
if [ ! -s "$ver_file" ]; then
  say "fetching deb-src lists (private, /etc/apt untouched)"
  apt-get "${aptsrc[@]}" update -q >&2
  ver=$(apt-get "${aptsrc[@]}" source --print-uris "$PKG" 2>/dev/null | awk '/\.dsc/{print $2}' | sed -E "s/^${PKG}_(.*)\.dsc$/\1/" | head -n1)
  [ -n "$ver" ] || { say "no source version found for $PKG"; exit 1; }
  echo "$ver" > "$ver_file"
fi
VER=$(cat "$ver_file")
OUT="$CACHE/k8s-$VER"
if [ -x "$OUT/bin/kube-proxy" ] && [ -x "$OUT/bin/kube-apiserver" ] && [ -x "$OUT/bin/kubelet" ] \
   && [ -x "$OUT/bin/kube-controller-manager" ] && [ -x "$OUT/bin/kube-scheduler" ]; then
  say "cached: $OUT/bin"; echo "$OUT/bin"; exit 0
fi
SRC="$CACHE/src/$PKG-$VER"
if [ ! -e "$SRC/.patched" ]; then
  rm -rf "$SRC"; mkdir -p "$SRC.dl"
  say "downloading source $PKG $VER"
  (cd "$SRC.dl" && apt-get "${aptsrc[@]}" source --download-only "$PKG=$VER" >&2)
  dsc=$(ls "$SRC.dl"/*.dsc | head -n1)
  command -v dpkg-source >/dev/null || { say "dpkg-source missing (dpkg-dev)"; exit 1; }
  say "unpacking and applying debian/patches"
  # dpkg-source -x applies the quilt series (3.0 (quilt) format).
  (cd "$SRC.dl" && dpkg-source --no-check -x "$dsc" x >&2)
  mv "$SRC.dl/x" "$SRC"; rm -rf "$SRC.dl"
  if [ ! -f "$SRC/.pc/applied-patches" ] && [ -f "$SRC/debian/patches/series" ]; then
    while read -r p; do case "$p" in ''|\#*) continue;; esac; patch -d "$SRC" -p1 -N < "$SRC/debian/patches/$p" >&2; done < "$SRC/debian/patches/series"
  fi
  # The vendored reflect2 crashes the apiserver under Go >= 1.18 (SIGSEGV in UnsafeMapType.UnsafeIterate);
  # Debian's 1.0.2 copy is the fix.
  R=/usr/share/gocode/src/github.com/modern-go/reflect2
  [ -d "$R" ] || { say "missing $R (golang-github-modern-go-reflect2-dev)"; exit 1; }
  rm -rf "$SRC/vendor/github.com/modern-go/reflect2"; mkdir -p "$SRC/vendor/github.com/modern-go/reflect2"
  cp "$R"/*.go "$R"/*.s "$SRC/vendor/github.com/modern-go/reflect2/" 2>/dev/null || cp "$R"/*.go "$SRC/vendor/github.com/modern-go/reflect2/"
  rm -f "$SRC/vendor/github.com/modern-go/reflect2/"*_test.go
  touch "$SRC/.patched"
fi
GOROOT=/usr/lib/go-1.19
[ -x "$GOROOT/bin/go" ] || { say "missing $GOROOT (golang-1.19-go)"; exit 1; }
# GOFLAGS must stay one token: hack/lib/golang.sh pastes what follows -tags= into its tag list.
# providerless leaves out the in-tree cloud providers (AWS, Azure, GCE, ...): a third of the
# compile time, and nothing a single local node uses.
export PATH="$GOROOT/bin:$PATH" GOROOT CGO_ENABLED=0 GOPROXY=off GOFLAGS=-tags=providerless \
       GOCACHE="$CACHE/gocache" GOPATH="$CACHE/gopath" \
       KUBE_GIT_VERSION=v1.20.2 KUBE_GIT_MAJOR=1 KUBE_GIT_MINOR=20 KUBE_GIT_TREE_STATE=clean
export GOMAXPROCS=${GOMAXPROCS:-2}
mkdir -p "$OUT/bin"
for w in "${WHAT[@]}"; do
  if [ -x "$OUT/bin/$w" ]; then continue; fi
  t0=$(date +%s)
  say "building $w"
  (cd "$SRC" && make WHAT="cmd/$w" >&2)
  bin=$(ls "$SRC"/_output/local/bin/linux/amd64/"$w" 2>/dev/null || ls "$SRC"/_output/bin/"$w")
  cp "$bin" "$OUT/bin/$w.tmp" && mv "$OUT/bin/$w.tmp" "$OUT/bin/$w"
  say "built $w in $(( $(date +%s) - t0 ))s"
done
echo "$OUT/bin"
