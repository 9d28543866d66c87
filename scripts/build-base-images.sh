#!/usr/bin/env bash
# Build dsec's standard base images from Debian packages (run as root).
#
#   scripts/build-base-images.sh [busybox|bookworm|python ...]   (default: all)
#
# For each image NAME this leaves in ${DSEC_IMAGE_DIR:-/var/lib/dsec/images}:
#   NAME.erofs    read-only EROFS image (lz4hc), the lower layer of a container's overlay
#   NAME.rootfs/  the same tree as a plain directory (tests may use it as a lower dir)
#   NAME.sha256   sha256 of NAME.erofs (hex digest only, one line)
#   NAME.recipe   sha256 of the recipe that built it; the image is rebuilt when it changes
# and, when a Docker daemon is reachable, the Docker image dsec/NAME:latest (docker import of
# the same tree), so benchmarks can compare against Docker on identical content.
#
# Idempotent and fast when everything is there. Environment:
#   DSEC_IMAGE_DIR      output directory (default /var/lib/dsec/images)
#   DSEC_DEBIAN_MIRROR  Debian mirror for debootstrap (default: the one apt uses here)
#   FORCE=1             rebuild even when the recipe stamp matches
#   SKIP_DOCKER=1       do not docker-import
set -euo pipefail

IMAGE_DIR=${DSEC_IMAGE_DIR:-/var/lib/dsec/images}
ALL_IMAGES=(busybox bookworm python e2b-base)

# Bump to force a rebuild of every image after a change the recipes below do not capture.
RECIPE_VERSION=1
MKFS_OPTS=(--quiet --all-root -zlz4hc)
# Images with files of other accounts keep every file's owner (the others are made root's):
# e2b-base's /home/user is uid 1000's, as E2B's user expects to write there.
KEEPS_OWNERS=" e2b-base "
mkfs_opts() {
    if [[ $KEEPS_OWNERS == *" $1 "* ]]; then
        echo --quiet -zlz4hc
    else
        echo "${MKFS_OPTS[*]}"
    fi
}
BOOKWORM_SUITE=bookworm
BOOKWORM_INCLUDE=python3,git,gcc,g++,make,ca-certificates,procps
# The FnCall python environment (edge/fncall): bookworm plus numpy, which its warm interpreters
# pre-import. A separate image, so the bookworm image (and everything built on it) stays as is.
PYTHON_INCLUDE=$BOOKWORM_INCLUDE,python3-numpy
# E2B's `base` template (compat/e2b maps it here): what E2B's base image offers — bash, sudo,
# curl, wget, git, python3 (also as `python`), pip and venv, the usual build tools — and E2B's
# user model: an account `user` (uid 1000, home /home/user, bash) that may sudo without a
# password; commands through the E2B front end run as it unless root is asked for.
E2B_BASE_INCLUDE=$BOOKWORM_INCLUDE,bash,sudo,curl,wget,python3-pip,python3-venv,python-is-python3,build-essential,unzip,less

log() { printf 'build-base-images: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $EUID -eq 0 ]] || die "must run as root"

# Temporary directories removed at exit (TMPDIRS), detect_mirror.
# shellcheck source=scripts/lib-debootstrap.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib-debootstrap.sh"

# --------------------------------------------------------------------------- recipes
# Each build_<name>_rootfs DIR fills the (not yet existing) directory DIR.
# recipe_<name> prints everything the result depends on; its sha256 is the NAME.recipe stamp.

build_busybox_rootfs() {
    local root=$1 applet
    mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,root,proc,sys,dev,work,var/tmp}
    install -d -m 1777 "$root/tmp"
    chmod 700 "$root/root"
    install -m 755 /bin/busybox "$root/bin/busybox"
    for applet in $("$root/bin/busybox" --list); do
        [[ $applet == busybox ]] && continue
        [[ -e $root/bin/$applet ]] || ln -s busybox "$root/bin/$applet"
    done
    ln -sf busybox "$root/bin/sh"
    ln -s ../../bin/busybox "$root/usr/bin/env"     # for '#!/usr/bin/env sh' scripts
    printf '%s\n' 'root:x:0:0:root:/root:/bin/sh' \
        'nobody:x:65534:65534:nobody:/nonexistent:/bin/false' >"$root/etc/passwd"
    printf '%s\n' 'root:x:0:' 'nogroup:x:65534:' >"$root/etc/group"
    printf '%s\n' '127.0.0.1	localhost' '::1	localhost ip6-localhost ip6-loopback' >"$root/etc/hosts"
    : >"$root/etc/resolv.conf"
    echo sandbox >"$root/etc/hostname"
}

recipe_busybox() {
    printf 'recipe-version=%s\nmkfs=%s\nbusybox-static=%s\n' "$RECIPE_VERSION" "${MKFS_OPTS[*]}" \
        "$(dpkg-query -W -f='${Version}' busybox-static)"
    declare -f build_busybox_rootfs
}

# debootstrap ROOT with the packages INCLUDE (comma-separated), cleaned of what a sandbox does
# not need.
debootstrap_rootfs() {
    local root=$1 include=$2 mirror
    mirror=$(detect_mirror)
    log "debootstrap $BOOKWORM_SUITE from $mirror (takes a few minutes)"
    debootstrap --variant=minbase --include="$include" \
        "$BOOKWORM_SUITE" "$root" "$mirror" >"$root.debootstrap.log" 2>&1 || {
        tail -n 30 "$root.debootstrap.log" >&2
        die "debootstrap failed (log above)"
    }
    # Keep it small: no package caches or index files (apt-get update refetches them).
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/archives/partial/* \
        "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/*
    mkdir -p "$root/var/lib/apt/lists/partial"
    # debootstrap copies the build host's resolver config and hostname; the runtime provides its own.
    : >"$root/etc/resolv.conf"
    echo sandbox >"$root/etc/hostname"
    mkdir -p "$root/work"
}

build_bookworm_rootfs() {
    local root=$1 mirror
    mirror=$(detect_mirror)
    log "debootstrap $BOOKWORM_SUITE from $mirror (takes a few minutes)"
    debootstrap --variant=minbase --include="$BOOKWORM_INCLUDE" \
        "$BOOKWORM_SUITE" "$root" "$mirror" >"$root.debootstrap.log" 2>&1 || {
        tail -n 30 "$root.debootstrap.log" >&2
        die "debootstrap failed (log above)"
    }
    # Keep it small: no package caches or index files (apt-get update refetches them).
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/archives/partial/* \
        "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/*
    mkdir -p "$root/var/lib/apt/lists/partial"
    # debootstrap copies the build host's resolver config and hostname; the runtime provides its own.
    : >"$root/etc/resolv.conf"
    echo sandbox >"$root/etc/hostname"
    mkdir -p "$root/work"
}

recipe_bookworm() {
    printf 'recipe-version=%s\nmkfs=%s\nsuite=%s\ninclude=%s\ndebootstrap=%s\n' \
        "$RECIPE_VERSION" "${MKFS_OPTS[*]}" "$BOOKWORM_SUITE" "$BOOKWORM_INCLUDE" \
        "$(dpkg-query -W -f='${Version}' debootstrap)"
    declare -f build_bookworm_rootfs
}

build_python_rootfs() {
    local root=$1 mirror
    mirror=$(detect_mirror)
    log "debootstrap $BOOKWORM_SUITE + python3-numpy from $mirror (takes a few minutes)"
    debootstrap --variant=minbase --include="$PYTHON_INCLUDE" \
        "$BOOKWORM_SUITE" "$root" "$mirror" >"$root.debootstrap.log" 2>&1 || {
        tail -n 30 "$root.debootstrap.log" >&2
        die "debootstrap failed (log above)"
    }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/archives/partial/* \
        "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/*
    mkdir -p "$root/var/lib/apt/lists/partial"
    : >"$root/etc/resolv.conf"
    echo sandbox >"$root/etc/hostname"
    mkdir -p "$root/work"
    # A broken image must fail here, not in every warm pool at start.
    chroot "$root" /usr/bin/python3 -c 'import numpy' || die "numpy does not import in $root"
}

build_e2b-base_rootfs() {
    local root=$1
    debootstrap_rootfs "$root" "$E2B_BASE_INCLUDE"
    chroot "$root" useradd --create-home --uid 1000 --user-group --shell /bin/bash user
    printf 'user ALL=(ALL:ALL) NOPASSWD: ALL\n' >"$root/etc/sudoers.d/user"
    chmod 440 "$root/etc/sudoers.d/user"
    # A broken image must fail here, not in the first E2B sandbox.
    chroot "$root" visudo -cq || die "the sudoers files of $root do not parse"
    local tool
    for tool in bash sudo curl wget git python python3 pip3 gcc make; do
        chroot "$root" sh -c "command -v $tool" >/dev/null || die "$tool is missing from $root"
    done
    [[ $(stat -c %u:%g "$root/home/user") == 1000:1000 ]] || die "/home/user is not uid 1000's in $root"
}

recipe_e2b-base() {
    printf 'recipe-version=%s\nmkfs=%s\nsuite=%s\ninclude=%s\ndebootstrap=%s\n' \
        "$RECIPE_VERSION" "$(mkfs_opts e2b-base)" "$BOOKWORM_SUITE" "$E2B_BASE_INCLUDE" \
        "$(dpkg-query -W -f='${Version}' debootstrap)"
    declare -f debootstrap_rootfs build_e2b-base_rootfs
}

recipe_python() {
    printf 'recipe-version=%s\nmkfs=%s\nsuite=%s\ninclude=%s\ndebootstrap=%s\n' \
        "$RECIPE_VERSION" "${MKFS_OPTS[*]}" "$BOOKWORM_SUITE" "$PYTHON_INCLUDE" \
        "$(dpkg-query -W -f='${Version}' debootstrap)"
    declare -f build_python_rootfs
}

# --------------------------------------------------------------------------- steps
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }

docker_reachable=
docker_ok() {
    if [[ -z $docker_reachable ]]; then
        if command -v docker >/dev/null && timeout 10 docker info >/dev/null 2>&1; then
            docker_reachable=yes
        else
            docker_reachable=no
        fi
    fi
    [[ $docker_reachable == yes ]]
}

# docker import NAME.rootfs as dsec/NAME:latest when missing or when the image was just rebuilt.
docker_import() {
    local name=$1 rebuilt=$2 tag="dsec/$1:latest"
    [[ ${SKIP_DOCKER:-0} == 1 ]] && return 0
    command -v docker >/dev/null || return 0
    if [[ $rebuilt == no ]] && docker image inspect "$tag" >/dev/null 2>&1; then
        return 0
    fi
    if ! docker_ok; then
        log "docker not reachable: $tag not imported"
        return 0
    fi
    tar --numeric-owner -C "$IMAGE_DIR/$name.rootfs" -c . |
        docker import --change 'CMD ["/bin/sh"]' - "$tag" >/dev/null
    log "imported $tag"
}

build_image() {
    local name=$1 t0 recipe_sha tmp rebuilt=no size status opts
    t0=$(now)
    recipe_sha=$("recipe_$name" | sha256sum | cut -d' ' -f1)
    if [[ ${FORCE:-0} != 1 && -f $IMAGE_DIR/$name.erofs && -d $IMAGE_DIR/$name.rootfs &&
        -f $IMAGE_DIR/$name.sha256 && "$(cat "$IMAGE_DIR/$name.recipe" 2>/dev/null)" == "$recipe_sha" ]]; then
        status=cached
    else
        status=built
        rebuilt=yes
        tmp=$(mktemp -d "$IMAGE_DIR/.$name.tmp.XXXXXX")
        TMPDIRS+=("$tmp")
        "build_${name}_rootfs" "$tmp/rootfs"
        read -ra opts <<<"$(mkfs_opts "$name")"
        mkfs.erofs "${opts[@]}" "$tmp/$name.erofs" "$tmp/rootfs" >/dev/null
        sha256sum "$tmp/$name.erofs" | cut -d' ' -f1 >"$tmp/$name.sha256"
        # Install: the stamp goes last, so an interrupted install is rebuilt next time.
        # Renames within one filesystem are atomic; a mounted old image keeps working.
        rm -f "$IMAGE_DIR/$name.recipe"
        mv -f "$tmp/$name.erofs" "$IMAGE_DIR/$name.erofs"
        mv -f "$tmp/$name.sha256" "$IMAGE_DIR/$name.sha256"
        if [[ -e $IMAGE_DIR/$name.rootfs ]]; then
            mv "$IMAGE_DIR/$name.rootfs" "$tmp/old.rootfs"   # deleted by the cleanup trap
        fi
        mv "$tmp/rootfs" "$IMAGE_DIR/$name.rootfs"
        echo "$recipe_sha" >"$tmp/$name.recipe"
        mv -f "$tmp/$name.recipe" "$IMAGE_DIR/$name.recipe"
    fi
    docker_import "$name" "$rebuilt"
    size=$(du -h --apparent-size "$IMAGE_DIR/$name.erofs" | cut -f1)
    printf '%-9s %-6s erofs %s  %s\n' "$name" "$status" "$size" "$(elapsed "$t0")"
}

# --------------------------------------------------------------------------- main
images=("$@")
[[ ${#images[@]} -gt 0 ]] || images=("${ALL_IMAGES[@]}")
for name in "${images[@]}"; do
    declare -F "build_${name}_rootfs" >/dev/null || die "unknown image '$name' (known: ${ALL_IMAGES[*]})"
done

mkdir -p "$IMAGE_DIR"
exec 9>"$IMAGE_DIR/.lock"
flock 9 # one builder at a time

for name in "${images[@]}"; do
    build_image "$name"
done
