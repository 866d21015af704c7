# Debian packages for the scripts that install what they need (.ci/k8s-lib.sh, images/build.sh):
# pins with a fallback, one `apt-get update` per run. The caller defines log() and may set
# APT_BEFORE_UPDATE to a function that adds package sources before the lists are fetched.

export DEBIAN_FRONTEND=noninteractive
# the sandbox user root: `apt-get source/download` write into folders _apt cannot
APT_OPTS=(-o DPkg::Lock::Timeout=600 -o APT::Sandbox::User=root)

apt_lists_ready=0
apt_update() {
    ((apt_lists_ready)) && return 0
    [[ -z ${APT_BEFORE_UPDATE:-} ]] || "$APT_BEFORE_UPDATE"
    apt-get "${APT_OPTS[@]}" update -qq
    apt_lists_ready=1
}

# apt_install PKG[=VERSION]...: installs what is missing; a superseded pin falls back to the
# archive's current version.
apt_install() {
    local missing=() p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "${p%%=*}" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    [[ $(id -u) == 0 ]] || { log "installing ${missing[*]} needs root"; exit 1; }
    apt_update
    log "apt-get install ${missing[*]}"
    if ! apt-get "${APT_OPTS[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
        log "pinned versions not available; installing the archive's current ones"
        apt-get "${APT_OPTS[@]}" install -y -qq --no-install-recommends "${missing[@]%%=*}" >/dev/null
    fi
}
