# Shared by .ci/k8s.sh (API-server binaries) and .ci/k8s-node.sh (node binaries): apt
# (.ci/apt-lib.sh) with source entries, and Kubernetes binaries built from Debian's `kubernetes`
# source package.
# The caller sets LOG_TAG, CACHE, KEY, BIN and NEEDED before sourcing this file.
#
# No prebuilt Kubernetes server is installable here, so the binaries are built from Debian's
# `kubernetes` 1.20 source package, which vendors all of its Go dependencies and builds offline
# with Debian's Go 1.19. Its vendored modern-go/reflect2 1.0.1 crashes under Go >= 1.18 on the
# first custom-resource write; the files of Debian's reflect2 1.0.2 replace it.

K8S_DEB_VERSION="1.20.5+really1.20.2-1.1+deb12u1"
K8S_GIT_VERSION="v1.20.2"

log() { echo "[$LOG_TAG] $*" >&2; }

have() { [[ -x "$BIN/$1" ]]; }

all_present() {
    local b
    for b in "${NEEDED[@]}"; do have "$b" || return 1; done
}

# deb-src entries mirroring the machine's own deb entries (deb822 or one-line style), for
# `apt-get source kubernetes`
add_deb_src() {
    local src=/etc/apt/sources.list.d/kvship-deb-src.sources
    [[ -f $src || -f /etc/apt/sources.list.d/kvship-deb-src.list ]] && return 0
    if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
        sed -e 's/^Types: deb$/Types: deb-src/' /etc/apt/sources.list.d/debian.sources > "$src"
    elif [[ -f /etc/apt/sources.list ]]; then
        grep -E '^deb ' /etc/apt/sources.list | sed -e 's/^deb /deb-src /' \
            > /etc/apt/sources.list.d/kvship-deb-src.list
    fi
}
APT_BEFORE_UPDATE=add_deb_src
source "$(dirname "${BASH_SOURCE[0]}")/apt-lib.sh"

# build_kube CMD...: builds cmd/CMD for each name from the source package into $BIN, in a build
# folder of this cache key (so the two scripts never touch each other's build).
build_kube() {
    local t0=$SECONDS work="$CACHE/build-$KEY" what=() c
    apt_install golang-1.19-go rsync dpkg-dev xz-utils make ca-certificates
    apt_update
    rm -rf "$work" && mkdir -p "$work"
    (
        cd "$work"
        log "apt-get source kubernetes=$K8S_DEB_VERSION"
        if ! apt-get source -qq "${APT_OPTS[@]}" "kubernetes=$K8S_DEB_VERSION" >/dev/null; then
            # superseded in the archive: take the release's current 1.20 source package
            log "kubernetes=$K8S_DEB_VERSION not available; using the archive's current kubernetes source"
            apt-get source -qq "${APT_OPTS[@]}" kubernetes >/dev/null
        fi
        # reflect2 1.0.2 source files (arch: all package; unpacked here, not installed)
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
    for c in "$@"; do what+=("cmd/$c"); done
    log "building $* (several minutes)"
    (
        cd "$src"
        export PATH="/usr/lib/go-1.19/bin:$PATH"
        export GOPATH="$work/gopath" GOCACHE="$work/gocache" GOFLAGS=-mod=vendor GO111MODULE=on
        # static, no cgo (nothing here needs it; saves compiling and linking through gcc);
        # a lazier GC trades memory (plenty) for compile time
        export CGO_ENABLED=0 GOGC=400
        export KUBE_GIT_VERSION_FILE="$work/version"
        export KUBE_VERBOSE=0
        make WHAT="${what[*]}" GOLDFLAGS="-s -w" >"$work/build.log" 2>&1 \
            || { tail -n 60 "$work/build.log" >&2; exit 1; }
    )
    mkdir -p "$BIN"
    local out
    for c in "$@"; do
        out=$(find "$src/_output" -type f -name "$c" -perm -u+x | head -n1)
        [[ -n $out ]] || { log "$c not built"; exit 1; }
        install -m 0755 "$out" "$BIN/$c"
    done
    rm -rf "$work"
    "$BIN/$1" --version >&2
    log "$* built in $((SECONDS - t0)) s"
}

# the usage line both scripts share: install | bindir | check
k8s_main() {
    case "${1:-install}" in
        install)
            [[ $(id -u) == 0 ]] || { all_present && exit 0; log "install needs root (apt-get)"; exit 1; }
            t0=$SECONDS
            install_steps
            all_present || { log "incomplete: $(ls "$BIN")"; exit 1; }
            log "in $BIN ($((SECONDS - t0)) s)"
            ;;
        bindir) echo "$BIN" ;;
        check) all_present ;;
        *) echo "usage: $0 install|bindir|check" >&2; exit 2 ;;
    esac
}
