#!/usr/bin/env bash
# Debian packages the test cluster needs (installed only when missing; root only). Their services
# must not start on their own (policy-rc.d): the harness runs its own etcd, containerd and dnsmasq.
set -euo pipefail
PKGS=(golang-1.19-go golang-github-modern-go-reflect2-dev dpkg-dev make gcc libc6-dev etcd-server containerd
      runc containernetworking-plugins iptables conntrack dnsmasq-base busybox-static curl openssl iproute2 python3
      rsync)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]})) || exit 0
[ "$(id -u)" = 0 ] || { echo "[cluster-deps] missing Debian packages: ${missing[*]} (not root)" >&2; exit 1; }
echo "[cluster-deps] installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get -o DPkg::Lock::Timeout=600 update -q >&2
made_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; made_policy=1
fi
apt-get -o DPkg::Lock::Timeout=600 install -y -q --no-install-recommends "${missing[@]}" >&2
((made_policy)) && rm -f /usr/sbin/policy-rc.d
true
