#!/usr/bin/env bash
# A real single-node Kubernetes (1.20.2 from Debian's source package) for the gpulens tests.
#   cluster.sh up [--nodes N]  build (cached) and start: etcd, apiserver, controller-manager, scheduler,
#                       containerd+runc+CNI bridge, kubelet, kube-proxy, cluster DNS; waits for Ready
#   cluster.sh down     stop everything and undo every side effect (sysctls, iptables chains,
#                       cgroups, mounts, netns, bridge, state, the chart's host folders it made);
#                       safe to run twice
#   cluster.sh status   one line per component; exit 0 only when the node is Ready
#   cluster.sh env      prints KUBECONFIG=... for the admin kubeconfig
#   cluster.sh load IMAGE.tar   import an image archive into the cluster's containerd
#   cluster.sh lose K   extra node K crashes: every process of it (containerd, kubelet, kube-proxy,
#                       every pod's) killed at once; its network, disk and cgroup parent stay
#   cluster.sh restore K   node K boots again on what it left: its components start, waits for a
#                       Ready it reports after the restore began
# Layout: binaries cached in $GPULENS_CLUSTER_CACHE (/var/cache/gpulens-cluster; kept by down),
# state in /var/lib/gpulens-cluster and /run/gpulens-cluster (removed by down).
# Network: bridge gl-cni0 10.244.0.1/24 (pods, node IP, apiserver, DNS), Services 10.96.0.0/16.
# Nodes: GPULENS_CLUSTER_NODES=N (or `up --nodes N`; default 1). Node 1 (gpulens-node) runs in the
# machine's own namespaces as above. Node k>=2 (gpulens-node-k) runs its containerd, kubelet and
# kube-proxy in network namespace gl-node-k plus a mount and PID namespace of their own: node IP
# 10.244.(k-1).1 on its own bridge, pods 10.244.(k-1).0/24, a veth gl-veth-k (10.245.k.1 <->
# 10.245.k.2) to the machine, host routes between the pod CIDRs (what a CNI's routes would do);
# its own /var/lib/gpulens and /run/gpulens (hostPath means that node only), its own /proc (hostPID
# means that node only), cgroup parent /gl-node-k. The count is kept in $RUN/node-count for down/status.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${GPULENS_CLUSTER_CACHE:-/var/cache/gpulens-cluster}
STATE=/var/lib/gpulens-cluster
RUN=/run/gpulens-cluster
PKI=$STATE/pki
LOGS=$STATE/logs
BR=gl-cni0
GW=10.244.0.1
POD_CIDR=10.244.0.0/24
SVC_CIDR=10.96.0.0/16
SVC_API=10.96.0.1
NODE=gpulens-node
APISERVER=https://$GW:6443
ETCD_PORT=23790
SOCK=$RUN/containerd.sock
PAUSE_REF=localhost/gpulens-pause:1
NODES=${GPULENS_CLUSTER_NODES:-1}
CLUSTER_CIDR=10.244.0.0/16
#: Host folders the chart's hostPath volumes use: each extra node gets its own copy of them. The
#: chart's defaults (/var/lib/gpulens, /run/gpulens) and the README's test-cluster values (node.paths
#: under the cluster's state, so that `down` removes them): an agent must see only its own node's
#: registrations, sockets and traces. And the kubelet's pod log folder: each kubelet removes the
#: log folders of pods it does not run, so a shared one loses the other node's container logs.
NODE_PRIVATE_DIRS=(/var/lib/gpulens /run/gpulens /var/lib/gpulens-cluster/node /run/gpulens-cluster/node
                   /var/log/pods /var/log/containers)
SYSCTLS=(net.ipv4.ip_forward net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables
         net.ipv4.conf.all.route_localnet vm.overcommit_memory kernel.panic kernel.panic_on_oops
         net.netfilter.nf_conntrack_max net.netfilter.nf_conntrack_tcp_timeout_established
         net.netfilter.nf_conntrack_tcp_timeout_close_wait kernel.keys.root_maxkeys kernel.keys.root_maxbytes)
say() { printf '[cluster] %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN{printf "%.1f", b-a}'; }

# ---- helpers ---------------------------------------------------------------------------------
wait_for() {  # wait_for SECONDS DESCRIPTION CMD...: poll CMD until it succeeds, or fail with the log hint
  local t=$1 what=$2; shift 2
  local end=$(( $(date +%s) + t ))
  until "$@" >/dev/null 2>&1; do
    (( $(date +%s) < end )) || { say "timed out after ${t}s waiting for $what"; return 1; }
    sleep 0.2
  done
}
start() {  # start NAME CMD...: run in the background, pid in $RUN/NAME.pid, log in $LOGS/NAME.log
  local name=$1; shift
  setsid "$@" >>"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! > "$RUN/$name.pid"
}
alive() { local p; p=$(cat "$RUN/$1.pid" 2>/dev/null) && kill -0 "$p" 2>/dev/null; }
kapi() {  # kapi PATH [curl args]: admin request to the apiserver
  local path=$1; shift
  curl -sf --max-time 10 --cacert "$PKI/ca.crt" --cert "$PKI/admin.crt" --key "$PKI/admin.key" "$@" "$APISERVER$path"
}

# ---- PKI -------------------------------------------------------------------------------------
cert() {  # cert NAME SUBJECT [SANS]: a key + CA-signed cert
  local name=$1 subj=$2 sans=${3:-}
  openssl genrsa -out "$PKI/$name.key" 2048 2>/dev/null
  openssl req -new -key "$PKI/$name.key" -subj "$subj" -out "$PKI/$name.csr" 2>/dev/null
  local ext="$PKI/$name.ext"
  { echo "basicConstraints=CA:FALSE"; echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=serverAuth,clientAuth"; [ -n "$sans" ] && echo "subjectAltName=$sans"; } > "$ext"
  openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
    -days 30 -sha256 -extfile "$ext" -out "$PKI/$name.crt" 2>/dev/null
  rm -f "$PKI/$name.csr" "$ext"
}
kubeconfig() {  # kubeconfig NAME CERTNAME
  cat > "$STATE/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: gpulens
  cluster: {server: "$APISERVER", certificate-authority: "$PKI/ca.crt"}
users:
- name: $1
  user: {client-certificate: "$PKI/$2.crt", client-key: "$PKI/$2.key"}
contexts:
- name: gpulens
  context: {cluster: gpulens, user: $1}
current-context: gpulens
EOF
}
make_pki() {
  mkdir -p "$PKI"; chmod 700 "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -days 30 \
    -subj "/CN=gpulens-cluster-ca" 2>/dev/null
  cert apiserver "/CN=kube-apiserver" \
    "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:$GW,IP:$SVC_API"
  cert admin "/O=system:masters/CN=admin"
  cert apiserver-kubelet "/O=system:masters/CN=kube-apiserver-kubelet-client"
  cert node "/O=system:nodes/CN=system:node:$NODE"
  cert kubelet-serving "/CN=$NODE" "DNS:$NODE,DNS:localhost,IP:127.0.0.1,IP:$GW"
  cert controller-manager "/CN=system:kube-controller-manager"
  cert scheduler "/CN=system:kube-scheduler"
  cert proxy "/CN=system:kube-proxy"
  openssl genrsa -out "$PKI/sa.key" 2048 2>/dev/null
  openssl rsa -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null
  kubeconfig admin admin; kubeconfig node node; kubeconfig controller-manager controller-manager
  kubeconfig scheduler scheduler; kubeconfig proxy proxy
}

# ---- side effects we own: recorded before up, undone by down -----------------------------------
#: The chart's default host folders (node.paths: registry, traces, agent state, Kineto's sockets,
#: tokens): the node DaemonSet's hostPath volumes make them on node 1. Those absent before `up` are
#: this cluster's doing, so `down` removes them whole; ones that were there are someone else's.
HOST_DIRS=(/var/lib/gpulens /run/gpulens)
save_host_dirs() {
  local d
  : > "$RUN/hostdirs.ours"
  for d in "${HOST_DIRS[@]}"; do [ -e "$d" ] || echo "$d" >> "$RUN/hostdirs.ours"; done
}
remove_host_dirs() {
  [ -s "$RUN/hostdirs.ours" ] || return 0
  local d
  while IFS= read -r d; do
    case $d in /var/lib/gpulens | /run/gpulens) rm -rf --one-file-system "$d" 2>/dev/null || say "could not remove $d" ;; esac
  done < "$RUN/hostdirs.ours"
}
save_sysctls() {
  [ -s "$RUN/sysctls.saved" ] && return 0
  local k
  for k in "${SYSCTLS[@]}"; do
    [ -e "/proc/sys/${k//.//}" ] && echo "$k=$(cat "/proc/sys/${k//.//}")"
  done > "$RUN/sysctls.saved"
}
save_our_sysctls() {  # the values while up: down restores a key only if it still holds ours
  local k
  for k in "${SYSCTLS[@]}"; do
    [ -e "/proc/sys/${k//.//}" ] && echo "$k=$(cat "/proc/sys/${k//.//}")"
  done > "$RUN/sysctls.ours"
}
restore_sysctls() {
  [ -s "$RUN/sysctls.saved" ] || return 0
  local line k cur ours
  while IFS= read -r line; do
    k=${line%%=*}
    cur=$(cat "/proc/sys/${k//.//}" 2>/dev/null) || continue
    ours=$(grep -m1 "^$k=" "$RUN/sysctls.ours" 2>/dev/null | cut -d= -f2-) || true
    # Someone else changed it after us (another tool on this machine): theirs now, leave it.
    if [ -n "$ours" ] && [ "$cur" != "$ours" ]; then say "leaving $k=$cur (changed by someone else)"; continue; fi
    [ "$cur" = "${line#*=}" ] || sysctl -q -w "$line" >/dev/null 2>&1 || say "could not restore $line"
  done < "$RUN/sysctls.saved"
}
drop_iptables_chains() {  # every KUBE-* chain (kubelet's and kube-proxy's) in every table, v4 and v6
  local ipt table line chain
  for ipt in iptables ip6tables; do
    for table in filter nat mangle raw; do
      $ipt -t $table -S >/dev/null 2>&1 || continue
      # jumps from any chain into ours first, then our chains' rules, then the chains
      $ipt -t $table -S | grep -E -- '-j KUBE-|-A KUBE-' | grep -v -- '^-A KUBE-' | sed 's/^-A /-D /' \
        | while IFS= read -r line; do eval "$ipt -t $table $line" 2>/dev/null || true; done || true
      for chain in $($ipt -t $table -S | awk '$1=="-N" && $2 ~ /^KUBE-/ {print $2}'); do
        $ipt -t $table -F "$chain" 2>/dev/null || true
      done
      for chain in $($ipt -t $table -S | awk '$1=="-N" && $2 ~ /^KUBE-/ {print $2}'); do
        $ipt -t $table -X "$chain" 2>/dev/null || true
      done
    done
  done
}
cgroup_roots() {  # node 1's kubepods and each extra node's cgroup parent (gl-node-K), in every hierarchy
  local d n
  for d in /sys/fs/cgroup/*/; do
    [ -d "$d/kubepods" ] && echo "$d/kubepods"
    for n in "$d"gl-node-*; do [ -d "$n" ] && echo "$n"; done
  done; true
}
kill_pod_processes() {  # every process in a pod cgroup (containers, pause): all started by this cluster
  local root f pid
  for root in $(cgroup_roots); do
    while IFS= read -r f; do
      # a cgroup may go while we read (its container just ended): nothing left to kill there
      while IFS= read -r pid; do kill -9 "$pid" 2>/dev/null || true; done 2>/dev/null < "$f" || true
    done < <(find "$root" -name cgroup.procs 2>/dev/null)
  done
}
remove_cgroups() {
  local root
  for root in $(cgroup_roots); do
    find "$root" -depth -type d -exec rmdir {} \; 2>/dev/null || true
  done
  if [ -n "$(cgroup_roots)" ]; then
    sleep 0.5; for root in $(cgroup_roots); do find "$root" -depth -type d -exec rmdir {} \; 2>/dev/null || true; done
  fi
}
our_pids() {  # our_pids [REGEX]: processes whose command line matches (default: names our state dirs)
  local p re=${1:-"$RUN/|$STATE/"}
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" = "$$" ] && continue
    tr '\0' ' ' 2>/dev/null < "$p/cmdline" | grep -qE -- "$re" && echo "${p#/proc/}"
  done; true
}
unmount_ours() {
  local m
  for _ in 1 2 3; do
    awk -v s="$STATE" -v r="$RUN" '$5 ~ "^" s || $5 ~ "^" r {print $5}' /proc/self/mountinfo | sort -r | \
      while IFS= read -r m; do umount -l "$m" 2>/dev/null || true; done || true
  done
  # network namespaces the CRI created for pod sandboxes (cni-<uuid>); recorded ones predate us
  if [ -d /run/netns ]; then
    for m in /run/netns/cni-*; do
      [ -e "$m" ] || continue
      grep -qxF "$m" "$RUN/netns.before" 2>/dev/null && continue
      umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true; rm -f "$m"
    done
    # `ip netns add` (extra nodes) makes /run/netns a mount point; ours if it was none before and is empty
    if [ "$(cat "$RUN/netns.mount" 2>/dev/null)" = no ] && mountpoint -q /run/netns && [ -z "$(ls -A /run/netns)" ]; then
      umount /run/netns 2>/dev/null || true
    fi
    [ "$(cat "$RUN/netns.dir" 2>/dev/null)" = created ] && rmdir /run/netns 2>/dev/null || true
  fi
}

# ---- components --------------------------------------------------------------------------------
write_configs() {
  mkdir -p "$STATE/cni/net.d" "$STATE/containerd" "$RUN/containerd" "$STATE/kubelet" "$RUN/dns"
  local proxy_cidr=$POD_CIDR; (( NODES > 1 )) && proxy_cidr=$CLUSTER_CIDR
  node_configs "$STATE" "$RUN" "$SOCK" "$POD_CIDR" "$GW" "$NODE" kubelet-serving proxy "" "$proxy_cidr" "$STATE/proxy.yaml"
}
# node_configs NSTATE NRUN SOCK POD_CIDR NODE_IP NODE_NAME SERVING_CERT PROXY_KUBECONFIG CGROUP_ROOT PROXY_CIDR PROXY_YAML:
# one node's CNI, containerd, kubelet and kube-proxy configuration.
node_configs() {
  local nstate=$1 nrun=$2 sock=$3 cidr=$4 ip=$5 name=$6 serving=$7 pkc=$8 cgroot=$9 pcidr=${10} pyaml=${11}
  mkdir -p "$nstate/cni/net.d" "$nstate/containerd" "$nrun/containerd" "$nstate/kubelet"
  cat > "$nstate/cni/net.d/10-gpulens.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "gpulens",
 "plugins": [{"type": "bridge", "bridge": "$BR", "isGateway": true, "ipMasq": false, "hairpinMode": true,
              "ipam": {"type": "host-local", "dataDir": "$nstate/cni/ipam", "ranges": [[{"subnet": "$cidr", "gateway": "$ip"}]],
                       "routes": [{"dst": "0.0.0.0/0"}]}},
             {"type": "loopback"}]}
EOF
  cat > "$nstate/containerd/config.toml" <<EOF
version = 2
root = "$nstate/containerd/root"
state = "$nrun/containerd/state"
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_REF"
  # pod sandboxes' netns files in containerd's own state folder, not the machine's /run/netns: the
  # first `ip netns add` of anyone else (another test's network-namespace nodes, run beside the
  # cluster) bind-mounts /run/netns onto itself and hides mounts made there before it, which then
  # nothing can unmount and `down` fails (rm: Device or resource busy). Under the state folder,
  # down's unmount of everything there takes them.
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$nstate/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = ""
EOF
  printf 'search cluster.local\nnameserver %s\noptions ndots:5\n' "$GW" > "$nstate/kubelet/resolv.conf"
  cat > "$nstate/kubelet/config.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $ip
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$PKI/ca.crt"}
authorization: {mode: Webhook}
tlsCertFile: "$PKI/$serving.crt"
tlsPrivateKeyFile: "$PKI/$serving.key"
cgroupDriver: cgroupfs
failSwapOn: false
maxOpenFiles: 20000
oomScoreAdj: 0
clusterDNS: ["$GW"]
clusterDomain: cluster.local
resolvConf: "$nstate/kubelet/resolv.conf"
serializeImagePulls: false
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
runtimeRequestTimeout: 5m
EOF
  if [ -n "$cgroot" ]; then echo "cgroupRoot: $cgroot" >> "$nstate/kubelet/config.yaml"; fi
  cat > "$pyaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: {kubeconfig: "$STATE/$pkc.kubeconfig"}
mode: iptables
hostnameOverride: $name
bindAddress: 127.0.0.1
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
clusterCIDR: $pcidr
conntrack: {maxPerCore: 0, min: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
EOF
}

build_pause() {
  local d="$CACHE/pause"
  local want; want=$(cat "$HERE/pause/pause.c" "$HERE/oci_image.py" | sha256sum | cut -c1-16)
  if [ "$(cat "$d/stamp" 2>/dev/null)" != "$want" ]; then
    mkdir -p "$d"
    gcc -static -Os -o "$d/pause" "$HERE/pause/pause.c"
    python3 "$HERE/oci_image.py" --ref "$PAUSE_REF" --out "$d/pause.tar" --entrypoint /pause --user 65535:65535 "$d/pause:pause" >/dev/null
    echo "$want" > "$d/stamp"
  fi
}

node_ready() {  # node_ready [NAME [EPOCH]]: the node (default node 1) reports Ready (in a heartbeat at or after EPOCH)
  kapi "/api/v1/nodes/${1:-$NODE}" | python3 -c 'import json,sys,datetime as d
since = float(sys.argv[1]); n = json.load(sys.stdin)
fresh = lambda c: d.datetime.strptime(c["lastHeartbeatTime"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=d.timezone.utc).timestamp() >= since
sys.exit(0 if any(c["type"] == "Ready" and c["status"] == "True" and fresh(c) for c in n["status"]["conditions"]) else 1)' "${2:-0}"
}
all_ready() {
  node_ready || return 1
  local k; for ((k = 2; k <= $(node_count); k++)); do node_vars "$k"; node_ready "$NNAME" || return 1; done
}
sa_ready() {  # the token Secret too: 1.20 refuses pods with a 500 until it exists
  kapi /api/v1/namespaces/default/serviceaccounts/default | python3 -c 'import json,sys; sys.exit(0 if json.load(sys.stdin).get("secrets") else 1)'
}

# ---- extra nodes (k >= 2): their own network, mount and PID namespaces ---------------------------
node_vars() {  # node_vars K: the N* names of node K
  local k=$1
  NNAME=gpulens-node-$k; NNS=gl-node-$k; NVETH=gl-veth-$k; NCG=gl-node-$k
  NIP=10.244.$((k - 1)).1; NCIDR=10.244.$((k - 1)).0/24
  XHOST=10.245.$k.1; XNODE=10.245.$k.2
  NSTATE=$STATE/nodes/$NNAME; NRUN=$RUN/nodes/$NNAME; NSOCK=$RUN/nodes/$NNAME/containerd.sock
}
node_count() { cat "$RUN/node-count" 2>/dev/null || echo 1; }
extra_nodes() {  # the K >= 2 of every extra node that is recorded or left anything behind
  { seq 2 "$(node_count)"
    local f; for f in /run/netns/gl-node-* "$RUN"/node-*.pid "$STATE"/nodes/gpulens-node-*; do
      [ -e "$f" ] || continue; f=${f##*-}; echo "${f%.pid}"; done
  } 2>/dev/null | grep -E '^[0-9]+$' | awk '$1 >= 2' | sort -un
}
node_pid1() {  # node_pid1 K: the machine's pid of PID 1 of node K's PID namespace
  local u; u=$(cat "$RUN/node-$1.pid" 2>/dev/null) || return 1
  pgrep -P "$u" | head -n1
}
node_exec() {  # node_exec K CMD...: run CMD inside node K's network, mount and PID namespaces
  local k=$1 p; shift
  p=$(node_pid1 "$k") && [ -n "$p" ] || return 1
  nsenter -t "$p" -n -m -p -- "$@"
}
node_alive() {  # node_alive K NAME: the component's pid file holds a pid inside the node's namespace
  local p; node_vars "$1"; p=$(cat "$NRUN/$2.pid" 2>/dev/null) || return 1
  node_exec "$1" kill -0 "$p" 2>/dev/null
}
node_pki() {
  node_vars "$1"
  cert "node-$1" "/O=system:nodes/CN=system:node:$NNAME"
  cert "kubelet-serving-$1" "/CN=$NNAME" "DNS:$NNAME,DNS:localhost,IP:127.0.0.1,IP:$NIP"
  kubeconfig "node-$1" "node-$1"
}
node_net_up() {  # the node's namespace, its bridge (node IP), a veth to the machine, routes both ways
  node_vars "$1"
  ip netns add "$NNS"
  ip link add "$NVETH" type veth peer name eth0 netns "$NNS"
  ip addr replace "$XHOST/24" dev "$NVETH"; ip link set "$NVETH" up
  ip -n "$NNS" link set lo up
  ip -n "$NNS" addr replace "$XNODE/24" dev eth0; ip -n "$NNS" link set eth0 up
  ip -n "$NNS" link add "$BR" type bridge
  ip -n "$NNS" addr replace "$NIP/24" dev "$BR"; ip -n "$NNS" link set "$BR" up
  ip -n "$NNS" route replace default via "$XHOST"
  ip route replace "$NCIDR" via "$XNODE" dev "$NVETH"
  nsenter --net="/run/netns/$NNS" sysctl -q -w net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 \
    net.bridge.bridge-nf-call-ip6tables=1
}
node_cgroups_up() {  # the node's cgroup parent /gl-node-K in every hierarchy (the kubelet wants it there)
  local d; node_vars "$1"
  for d in /sys/fs/cgroup/*/; do
    [ -e "$d/cgroup.procs" ] || continue
    mkdir -p "$d$NCG"
    if [ -e "$d/cpuset.cpus" ]; then
      cat "$d/cpuset.cpus" > "$d$NCG/cpuset.cpus"; cat "$d/cpuset.mems" > "$d$NCG/cpuset.mems"
    fi
  done
}
node_start() {  # node K's PID 1 (cmd_node_init) in its namespaces; killing the pid on record ends them all
  local k=$1; node_vars "$k"
  mkdir -p "$NRUN" "$NSTATE"
  node_configs "$NSTATE" "$NRUN" "$NSOCK" "$NCIDR" "$NIP" "$NNAME" "kubelet-serving-$k" proxy "/$NCG" \
    "$CLUSTER_CIDR" "$NSTATE/proxy.yaml"
  start "node-$k" nsenter --net="/run/netns/$NNS" unshare --mount --propagation private --pid --fork \
    --kill-child=SIGKILL --mount-proc bash "$HERE/cluster.sh" _node_init "$k"
}
cmd_node_init() {  # inside node K's namespaces, as its PID 1: private host folders, then the components
  local k=$1 d BIN; node_vars "$k"; BIN=$(cat "$RUN/bin")
  for d in "${NODE_PRIVATE_DIRS[@]}"; do mkdir -p "$NSTATE/host$d"; mount --bind "$NSTATE/host$d" "$d"; done
  mount -t tmpfs -o mode=0755 gl-netns /run/netns      # the pod sandboxes' netns files: this node's only
  nstart() { local name=$1; shift; setsid "$@" >>"$LOGS/node-$k-$name.log" 2>&1 < /dev/null & echo $! > "$NRUN/$name.pid"; }
  nstart containerd /usr/bin/containerd --config "$NSTATE/containerd/config.toml"
  wait_for 30 "node-$k containerd" ctr --address "$NSOCK" version
  ctr --address "$NSOCK" -n k8s.io images import "$CACHE/pause/pause.tar" >/dev/null
  nstart kubelet "$BIN/kubelet" --config="$NSTATE/kubelet/config.yaml" --kubeconfig="$STATE/node-$k.kubeconfig" \
    --container-runtime=remote --container-runtime-endpoint="unix://$NSOCK" --image-service-endpoint="unix://$NSOCK" \
    --hostname-override="$NNAME" --node-ip="$NIP" --root-dir="$NSTATE/kubelet" --cert-dir="$PKI/kubelet-$k" --v=1
  nstart proxy "$BIN/kube-proxy" --config="$NSTATE/proxy.yaml"
  touch "$NRUN/started"
  say "node $NNAME started"
  trap '' TERM INT
  while :; do sleep 3600 & wait $! || true; done    # PID 1: stays, and reaps the orphans
}
node_down() {  # stop node K's components, end its namespaces, undo its network and cgroups
  local k=$1 name p p1 u; node_vars "$k"
  p1=$(node_pid1 "$k" 2>/dev/null) || p1=
  if [ -n "$p1" ]; then
    for name in proxy kubelet; do
      p=$(cat "$NRUN/$name.pid" 2>/dev/null) && nsenter -t "$p1" -p -- kill "$p" 2>/dev/null || true
    done
    wait_for 15 "node-$k kubelet to exit" bash -c "! nsenter -t $p1 -p -- kill -0 $(cat "$NRUN/kubelet.pid" 2>/dev/null || echo 999999) 2>/dev/null" || true
    kill -9 "$p1" 2>/dev/null || true         # PID 1: the kernel ends every process of the namespace
    wait_for 20 "node-$k PID namespace to end" bash -c "! kill -0 $p1 2>/dev/null" || say "node-$k PID 1 ($p1) still there"
  fi
  u=$(cat "$RUN/node-$k.pid" 2>/dev/null) && kill -9 "$u" 2>/dev/null || true
  ip route del "$NCIDR" 2>/dev/null || true
  ip link del "$NVETH" 2>/dev/null || true
  [ -e "/run/netns/$NNS" ] && { ip netns del "$NNS" 2>/dev/null || say "could not delete netns $NNS"; }
  true
}
extra_node() {  # extra_node K: die unless K names an extra node of this cluster
  [[ ${1:-} =~ ^[0-9]+$ ]] && (( $1 >= 2 && $1 <= $(node_count) )) || die "K must be an extra node: 2..$(node_count) (got '${1:-}')"
}
cmd_lose() {  # node K as a machine that crashed: PID 1 of its PID namespace killed, so every process in it
  local k=${1:-} p1; extra_node "$k"; node_vars "$k"
  p1=$(node_pid1 "$k") && [ -n "$p1" ] || die "node $NNAME is not running (lost already?)"
  kill -9 "$p1"
  wait_for 30 "node-$k PID namespace to end" bash -c "! kill -0 $p1 2>/dev/null"
  say "node $NNAME lost: its containerd, kubelet, kube-proxy and pods' processes are gone; network, disk, cgroups kept"
}
cmd_restore() {  # node K boots again: the same state folders, network and cgroup parent
  local k=${1:-} t; extra_node "$k"; node_vars "$k"
  [ -z "$(node_pid1 "$k" 2>/dev/null)" ] || die "node $NNAME is running; lose it first"
  t=$(date +%s)
  node_cgroups_up "$k"
  node_start "$k"
  wait_for 60 "node-$k kubelet" node_alive "$k" kubelet
  wait_for 240 "node $NNAME Ready again" node_ready "$NNAME" "$t"
  say "node $NNAME restored in $(( $(date +%s) - t ))s"
}
private_dirs_up() {  # the mount points of the nodes' own host folders; down removes the ones made here
  local d
  for d in "${NODE_PRIVATE_DIRS[@]}"; do
    [ -d "$d" ] && continue
    mkdir -p "$d"
    case $d in "$STATE"/* | "$RUN"/*) ;; *) echo "$d" >> "$RUN/dirs.made" ;; esac   # the state goes whole
  done
}

cmd_up() {
  local t0; t0=$(now)
  [ "$(id -u)" = 0 ] || die "needs root"
  [[ "$NODES" =~ ^[1-9][0-9]?$ ]] || die "the node count must be 1..99, not '$NODES'"
  if [ -e "$RUN/up" ] && [ "$(node_count)" = "$NODES" ] && all_ready; then say "already up"; cmd_env; return 0; fi
  [ -e "$RUN" ] && { say "leftovers from an earlier run: cleaning up first"; cmd_down; }
  bash "$HERE/deps.sh"
  local BIN; BIN=$(bash "$HERE/build.sh" | tail -n1)
  local tb; tb=$(elapsed "$t0"); say "binaries ready (${tb}s): $BIN"
  mkdir -p "$RUN" "$STATE" "$LOGS"
  echo "$BIN" > "$RUN/bin"
  echo "$NODES" > "$RUN/node-count"
  save_sysctls
  save_host_dirs
  ls -d /run/netns/cni-* 2>/dev/null > "$RUN/netns.before" || true
  [ -d /run/netns ] && echo existed > "$RUN/netns.dir" || echo created > "$RUN/netns.dir"
  mountpoint -q /run/netns 2>/dev/null && echo yes > "$RUN/netns.mount" || echo no > "$RUN/netns.mount"
  make_pki; write_configs; build_pause
  local k; for ((k = 2; k <= NODES; k++)); do node_pki "$k"; done
  sysctl -q -w net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 net.bridge.bridge-nf-call-ip6tables=1
  # The bridge exists before anything else: apiserver, kubelet and DNS bind its gateway address.
  ip link add "$BR" type bridge 2>/dev/null || true
  ip addr replace "$GW/24" dev "$BR"; ip link set "$BR" up

  # etcd on tmpfs: its fsyncs on a busy shared disk stretch the apiserver's bootstrap to minutes.
  mkdir -p "$STATE/etcd"; mount -t tmpfs -o size=512m,mode=0700 gpulens-etcd "$STATE/etcd"
  start etcd /usr/bin/etcd --name gpulens --data-dir "$STATE/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls http://127.0.0.1:23800 --initial-advertise-peer-urls http://127.0.0.1:23800 \
    --initial-cluster gpulens=http://127.0.0.1:23800
  wait_for 30 etcd curl -sf "http://127.0.0.1:$ETCD_PORT/health"

  start apiserver "$BIN/kube-apiserver" --etcd-servers="http://127.0.0.1:$ETCD_PORT" \
    --bind-address="$GW" --secure-port=6443 --advertise-address="$GW" --insecure-port=0 \
    --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction --allow-privileged=true \
    --service-cluster-ip-range="$SVC_CIDR" --client-ca-file="$PKI/ca.crt" \
    --tls-cert-file="$PKI/apiserver.crt" --tls-private-key-file="$PKI/apiserver.key" \
    --kubelet-client-certificate="$PKI/apiserver-kubelet.crt" --kubelet-client-key="$PKI/apiserver-kubelet.key" \
    --kubelet-certificate-authority="$PKI/ca.crt" --kubelet-preferred-address-types=InternalIP,Hostname \
    --service-account-key-file="$PKI/sa.pub" --service-account-signing-key-file="$PKI/sa.key" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local --api-audiences=https://kubernetes.default.svc.cluster.local \
    --profiling=false --v=1
  wait_for 240 "apiserver /readyz" kapi /readyz

  start controller-manager "$BIN/kube-controller-manager" --kubeconfig="$STATE/controller-manager.kubeconfig" \
    --authentication-kubeconfig="$STATE/controller-manager.kubeconfig" --authorization-kubeconfig="$STATE/controller-manager.kubeconfig" \
    --service-account-private-key-file="$PKI/sa.key" --root-ca-file="$PKI/ca.crt" \
    --cluster-signing-cert-file="$PKI/ca.crt" --cluster-signing-key-file="$PKI/ca.key" \
    --use-service-account-credentials --leader-elect=false --port=0 --bind-address=127.0.0.1 --secure-port=10257 \
    --allocate-node-cidrs=false --controllers='*,-nodeipam,-cloud-node-lifecycle' --profiling=false
  start scheduler "$BIN/kube-scheduler" --kubeconfig="$STATE/scheduler.kubeconfig" \
    --authentication-kubeconfig="$STATE/scheduler.kubeconfig" --authorization-kubeconfig="$STATE/scheduler.kubeconfig" \
    --leader-elect=false --port=0 --bind-address=127.0.0.1 --secure-port=10259 --profiling=false

  start containerd /usr/bin/containerd --config "$STATE/containerd/config.toml"
  wait_for 30 containerd ctr --address "$SOCK" version
  ctr --address "$SOCK" -n k8s.io images import "$CACHE/pause/pause.tar" >/dev/null

  start kubelet "$BIN/kubelet" --config="$STATE/kubelet/config.yaml" --kubeconfig="$STATE/node.kubeconfig" \
    --container-runtime=remote --container-runtime-endpoint="unix://$SOCK" --image-service-endpoint="unix://$SOCK" \
    --hostname-override="$NODE" --node-ip="$GW" --root-dir="$STATE/kubelet" --cert-dir="$PKI/kubelet" --v=1
  start proxy "$BIN/kube-proxy" --config="$STATE/proxy.yaml"
  if (( NODES > 1 )); then
    private_dirs_up
    for ((k = 2; k <= NODES; k++)); do node_net_up "$k"; node_cgroups_up "$k"; node_start "$k"; done
  fi

  # cluster DNS: dnsmasq answers cluster.local from files the feeder keeps in step with Services
  : > "$RUN/dns/services"
  start dnsmasq /usr/sbin/dnsmasq --keep-in-foreground --conf-file=/dev/null --no-resolv --no-hosts \
    --bind-interfaces --listen-address="$GW" --except-interface=lo --port=53 --local=/cluster.local/ \
    --hostsdir="$RUN/dns" --no-negcache --pid-file="$RUN/dnsmasq.real.pid" --user=root --log-facility=-
  start dns-feed python3 "$HERE/dns_feed.py" --server "$APISERVER" --ca "$PKI/ca.crt" \
    --cert "$PKI/admin.crt" --key "$PKI/admin.key" --out "$RUN/dns/services"

  wait_for 240 "node Ready" node_ready
  for ((k = 2; k <= NODES; k++)); do node_vars "$k"; wait_for 240 "node $NNAME Ready" node_ready "$NNAME"; done
  wait_for 120 "default ServiceAccount" sa_ready
  wait_for 30 "kube-proxy rules" iptables -t nat -S KUBE-SERVICES
  save_our_sysctls
  touch "$RUN/up"
  say "up in $(elapsed "$t0")s (binaries ${tb}s, $NODES node(s)); KUBECONFIG=$STATE/admin.kubeconfig"
  cmd_env
}

cmd_down() {
  local t0 name pid k; t0=$(now)
  [ -e "$RUN" ] || [ -e "$STATE" ] || [ -n "$(extra_nodes)" ] || { say "not running"; return 0; }
  # Controllers first (they would recreate what is deleted), then ask the kubelet to tear pod
  # sandboxes down properly (CNI DEL, volume unmounts) while it still runs.
  for name in controller-manager scheduler; do
    pid=$(cat "$RUN/$name.pid" 2>/dev/null) && kill "$pid" 2>/dev/null || true
  done
  if alive apiserver; then
    local ns
    for ns in $(kapi /api/v1/namespaces | python3 -c 'import json,sys; print(" ".join(i["metadata"]["name"] for i in json.load(sys.stdin)["items"]))' 2>/dev/null); do
      kapi "/api/v1/namespaces/$ns/pods?gracePeriodSeconds=0" -X DELETE -o /dev/null || true
    done
    wait_for 30 "pods gone" bash -c "! ls -d $STATE/kubelet/pods/*/ $STATE/nodes/*/kubelet/pods/*/ >/dev/null 2>&1" || true
  fi
  for k in $(extra_nodes); do node_down "$k"; done
  for name in dns-feed dnsmasq proxy kubelet scheduler controller-manager apiserver; do
    pid=$(cat "$RUN/$name.pid" 2>/dev/null) || continue
    kill "$pid" 2>/dev/null || true
  done
  for name in dns-feed dnsmasq proxy kubelet scheduler controller-manager apiserver; do
    wait_for 15 "$name to exit" bash -c "! kill -0 $(cat "$RUN/$name.pid" 2>/dev/null || echo 999999999)" \
      || kill -9 "$(cat "$RUN/$name.pid")" 2>/dev/null || true
  done
  kill_pod_processes
  for pid in $(our_pids "containerd-shim.* $SOCK"); do kill -9 "$pid" 2>/dev/null || true; done
  for name in containerd etcd; do
    pid=$(cat "$RUN/$name.pid" 2>/dev/null) || continue
    kill "$pid" 2>/dev/null || true
    wait_for 15 "$name to exit" bash -c "! kill -0 $pid" || kill -9 "$pid" 2>/dev/null || true
  done
  for pid in $(our_pids); do kill -9 "$pid" 2>/dev/null || true; done
  wait_for 10 "our processes gone" bash -c "[ -z \"\$(bash '$0' _our_pids)\" ]" || true
  if [ -x "$(cat "$RUN/bin" 2>/dev/null)/kube-proxy" ]; then
    "$(cat "$RUN/bin")/kube-proxy" --cleanup >/dev/null 2>&1 || true
  fi
  drop_iptables_chains
  kill_pod_processes
  remove_cgroups
  unmount_ours
  ip link del "$BR" 2>/dev/null || true
  for k in $(extra_nodes); do node_down "$k"; done     # a second pass, for anything the first missed
  if [ -s "$RUN/dirs.made" ]; then
    while IFS= read -r d; do rmdir "$d" 2>/dev/null || say "leaving $d (not empty)"; done < "$RUN/dirs.made"
  fi
  remove_host_dirs
  # veths whose pod netns is gone disappear with it; any still attached to nothing are ours only
  # if they were enslaved to our bridge, which no longer exists
  restore_sysctls
  rm -rf "$STATE" "$RUN"
  say "down in $(elapsed "$t0")s"
}

cmd_status() {
  local name rc=0
  for name in etcd apiserver controller-manager scheduler containerd kubelet proxy dnsmasq dns-feed; do
    if alive "$name"; then echo "$name running pid $(cat "$RUN/$name.pid")"; else echo "$name stopped"; rc=1; fi
  done
  if [ -e "$PKI/admin.crt" ] && node_ready 2>/dev/null; then echo "node $NODE Ready"; else echo "node $NODE not ready"; rc=1; fi
  local k
  for ((k = 2; k <= $(node_count); k++)); do
    node_vars "$k"
    for name in containerd kubelet proxy; do
      if node_alive "$k" "$name"; then echo "node-$k $name running pid $(cat "$NRUN/$name.pid") (in its namespace)"
      else echo "node-$k $name stopped"; rc=1; fi
    done
    if [ -e "$PKI/admin.crt" ] && node_ready "$NNAME" 2>/dev/null; then echo "node $NNAME Ready"; else echo "node $NNAME not ready"; rc=1; fi
  done
  return $rc
}
cmd_env() { echo "KUBECONFIG=$STATE/admin.kubeconfig"; }
cmd_load() {
  [ -n "${1:-}" ] || die "usage: cluster.sh load IMAGE.tar"
  ctr --address "$SOCK" -n k8s.io images import --all-platforms "$1" >&2
  local k; for ((k = 2; k <= $(node_count); k++)); do
    node_vars "$k"; ctr --address "$NSOCK" -n k8s.io images import --all-platforms "$1" >&2
  done
}

case "${1:-}" in
  up) shift; while (( $# )); do case "$1" in --nodes) NODES=${2:-}; shift 2 ;; --nodes=*) NODES=${1#*=}; shift ;;
                                 *) die "unknown option $1" ;; esac; done; cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) cmd_env ;;
  load) shift; cmd_load "$@" ;;
  lose) cmd_lose "${2:-}" ;;
  restore) cmd_restore "${2:-}" ;;
  _our_pids) our_pids ;;
  _node_init) cmd_node_init "$2" ;;
  *) echo "usage: $0 up [--nodes N]|down|status|env|load IMAGE.tar|lose K|restore K" >&2; exit 2 ;;
esac
