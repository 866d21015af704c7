#!/usr/bin/env bash
# Node binaries for the end-to-end test's single-node cluster (.ci/e2e.sh): kubelet,
# kube-scheduler, kube-proxy and kubectl, plus the Debian packages a node needs (containerd,
# runc, CNI plugins, iptables, conntrack).
#
#   bash .ci/k8s-node.sh install   build into the cache (idempotent; seconds when cached)
#   bash .ci/k8s-node.sh bindir    print the folder holding the binaries
#   bash .ci/k8s-node.sh check     exit 0 when every binary is present
#
# Built like .ci/k8s.sh builds kube-apiserver / kube-controller-manager (Debian's `kubernetes`
# 1.20 source package, vendored Go modules, Debian's Go 1.19, reflect2 1.0.2 swapped in), but
# under its own cache key and its own build folder, so that the API-server build and its cache
# are never rebuilt or touched by this step.
set -euo pipefail

K8S_DEB_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
K8S_GIT_VERSION="v1.20.2"
RECIPE=1
CACHE="${KVSHIP_K8S_CACHE:-/var/cache/kvship-k8s}"
KEY="k8s-node-${K8S_GIT_VERSION}-deb12u1-r${RECIPE}"
BIN="$CACHE/$KEY/bin"
NEEDED=(kubelet kube-scheduler kube-proxy kubectl)
# Debian bookworm packages of the node (pinned; the archive's current version is taken, with a
# warning, when a pin has been superseded).
NODE_PKGS=(
    "containerd=1.6.20~ds1-1+deb12u3"
    "runc=1.1.5+ds1-1+deb12u1"
    "containernetworking-plugins=1.1.1+ds1-3+b5"
    "iptables=1.8.9-2"
    "conntrack=1:1.4.7-1+b2"
    "iproute2"
    "openssl"
    "curl"
)

export DEBIAN_FRONTEND=noninteractive
APT_OPTS=(-o DPkg::Lock::Timeout=600 -o APT::Sandbox::User=root)

log() { echo "[k8s-node.sh] $*" >&2; }

have() { [[ -x "$BIN/$1" ]]; }

all_present() {
    local b
    for b in "${NEEDED[@]}"; do have "$b" || return 1; done
}

apt_ready=0
apt_prepare() {
    [[ $apt_ready == 1 ]] && return 0
    local src=/etc/apt/sources.list.d/kvship-deb-src.sources
    if [[ ! -f $src && ! -f /etc/apt/sources.list.d/kvship-deb-src.list ]]; then
        if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
            sed -e 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > "$src"
        elif [[ -f /etc/apt/sources.list ]]; then
            grep -E '^deb ' /etc/apt/sources.list | sed -e 's/^deb /deb-src /' \
                > /etc/apt/sources.list.d/kvship-deb-src.list
        fi
    fi
    apt-get "${APT_OPTS[@]}" update -qq
    apt_ready=1
}

# apt_install PKG[=VERSION]...: installs what is missing; a superseded pin falls back to the
# archive's current version.
apt_install() {
    local missing=() p name
    for p in "$@"; do
        name=${p%%=*}
        dpkg-query -W -f='${Status}' "$name" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    apt_prepare
    log "apt-get install ${missing[*]}"
    if ! apt-get "${APT_OPTS[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
        log "pinned versions not available; installing the archive's current ones"
        apt-get "${APT_OPTS[@]}" install -y -qq --no-install-recommends "${missing[@]%%=*}" >/dev/null
    fi
}

build_node() {
    all_present && return 0
    local t0=$SECONDS work="$CACHE/build-$KEY"
    apt_install golang-1.19-go rsync dpkg-dev xz-utils make ca-certificates
    apt_prepare
    rm -rf "$work" && mkdir -p "$work"
    (
        cd "$work"
        log "apt-get source kubernetes=$K8S_DEB_VERSION"
        if ! apt-get source -qq "${APT_OPTS[@]}" "kubernetes=$K8S_DEB_VERSION" >/dev/null; then
            log "kubernetes=$K8S_DEB_VERSION not available; using the archive's current kubernetes source"
            apt-get source -qq "${APT_OPTS[@]}" kubernetes >/dev/null
        fi
        apt-get download -qq "${APT_OPTS[@]}" golang-github-modern-go-reflect2-dev
        dpkg-deb -x golang-github-modern-go-reflect2-dev_*.deb reflect2-deb
    )
    local src
    src=$(find "$work" -maxdepth 1 -type d -name 'kubernetes-*' | head -n1)
    [[ -n $src ]] || { log "kubernetes source not unpacked"; exit 1; }
    local vend="$src/vendor/github.com/modern-go/reflect2"
    local new="$work/reflect2-deb/usr/share/gocode/src/github.com/modern-go/reflect2"
    [[ -d $vend && -d $new ]] || { log "reflect2 folders missing ($vend, $new)"; exit 1; }
    rm -f "$vend"/*.go "$vend"/*.s
    cp "$new"/*.go "$vend"/
    cp "$new"/*.s "$vend"/ 2>/dev/null || true
    rm -f "$vend"/*_test.go
    cat > "$work/version" <<VERSION
KUBE_GIT_VERSION='${K8S_GIT_VERSION}'
KUBE_GIT_MAJOR='1'
KUBE_GIT_MINOR='20'
KUBE_GIT_TREE_STATE='clean'
KUBE_GIT_COMMIT='0000000000000000000000000000000000000000'
VERSION
    log "building ${NEEDED[*]} (several minutes)"
    (
        cd "$src"
        export PATH="/usr/lib/go-1.19/bin:$PATH"
        export GOPATH="$work/gopath" GOCACHE="$work/gocache" GOFLAGS=-mod=vendor GO111MODULE=on
        export CGO_ENABLED=0 GOGC=400
        export KUBE_GIT_VERSION_FILE="$work/version"
        export KUBE_VERBOSE=0
        make WHAT="cmd/kubelet cmd/kube-scheduler cmd/kube-proxy cmd/kubectl" GOLDFLAGS="-s -w" \
            >"$work/build.log" 2>&1 || { tail -n 60 "$work/build.log" >&2; exit 1; }
    )
    mkdir -p "$BIN"
    local out b
    for b in "${NEEDED[@]}"; do
        out=$(find "$src/_output" -type f -name "$b" -perm -u+x | head -n1)
        [[ -n $out ]] || { log "$b not built"; exit 1; }
        install -m 0755 "$out" "$BIN/$b"
    done
    rm -rf "$work"
    "$BIN/kubelet" --version >&2
    log "node binaries built in $((SECONDS - t0)) s"
}

case "${1:-install}" in
    install)
        [[ $(id -u) == 0 ]] || { log "install needs root (apt-get)"; exit 1; }
        t0=$SECONDS
        apt_install "${NODE_PKGS[@]}"
        if all_present; then log "cached in $BIN"; exit 0; fi
        mkdir -p "$CACHE"
        build_node
        all_present || { log "incomplete: $(ls "$BIN")"; exit 1; }
        log "installed into $BIN in $((SECONDS - t0)) s"
        ;;
    bindir) echo "$BIN" ;;
    check) all_present ;;
    *) echo "usage: $0 install|bindir|check" >&2; exit 2 ;;
esac
