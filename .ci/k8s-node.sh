#!/usr/bin/env bash
# Node binaries for the end-to-end test's single-node cluster (.ci/e2e.sh): kubelet,
# kube-scheduler, kube-proxy and kubectl, plus the Debian packages a node needs (containerd,
# runc, CNI plugins, iptables, conntrack).
#
#   bash .ci/k8s-node.sh install   build into the cache (idempotent; seconds when cached)
#   bash .ci/k8s-node.sh bindir    print the folder holding the binaries
#   bash .ci/k8s-node.sh check     exit 0 when every binary is present
#
# Built as .ci/k8s.sh builds the API-server binaries (.ci/k8s-lib.sh), under its own cache key
# and build folder, so that the API-server build and its cache are never touched by this step.
set -euo pipefail

LOG_TAG=k8s-node.sh
RECIPE=1
CACHE="${KVSHIP_K8S_CACHE:-/var/cache/kvship-k8s}"
KEY="k8s-node-v1.20.2-deb12u1-r${RECIPE}"
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
source "$(dirname "$0")/k8s-lib.sh"

install_steps() {
    apt_install "${NODE_PKGS[@]}"
    if all_present; then log "cached"; return 0; fi
    mkdir -p "$CACHE"
    build_kube "${NEEDED[@]}"
}

k8s_main "$@"
