#!/usr/bin/env bash
# Build the full-VM backend's disk images (edge/backends/vm) from Debian packages:
#
#   scripts/build-vm-images.sh [bookworm] [desktop]
#
# Each image is a directory $DSEC_VM_IMAGE_DIR/<name>/ (default /var/lib/dsec/vm-images):
#
#   disk.qcow2    the root filesystem (ext4, no partition table) of a complete Debian 12 system
#                 booting its own init (systemd); every sandbox gets a copy-on-write overlay
#   vmlinuz       the image's own kernel (Debian's linux-image-amd64) and its initramfs,
#   initrd.img    booted directly by QEMU (no boot loader in the image)
#   image.json    name, kernel release, root size, whether it has a display, recipe hash
#
# bookworm: systemd, udev, the kernel, sudo, curl, python3; aether runs as a system service
#   (dsec-aether.service) from the toolkit disk (serial "tk", mounted at /.dsec) and talks to the
#   edge over the virtio-serial port dsec.aether, as in a microVM.
# desktop: bookworm + Xorg on the VM's virtual display (dsec-xorg.service, display :0), an Xfce
#   session of user "user" (dsec-desktop.service), Chromium, xfce4-terminal, mousepad, xdotool,
#   scrot, x11vnc and noVNC (what the e2b-desktop SDK runs inside its sandbox), Xvfb.
#
# Idempotent: an image whose recipe hash matches is kept. Environment:
#   DSEC_VM_IMAGE_DIR   output directory
#   DSEC_DEBIAN_MIRROR  Debian mirror (default: the one apt uses here)
#   FORCE=1             rebuild even when the recipe matches
set -euo pipefail

IMAGE_DIR=${DSEC_VM_IMAGE_DIR:-/var/lib/dsec/vm-images}
ALL_IMAGES=(bookworm desktop)
RECIPE_VERSION=1
BOOKWORM_SUITE=bookworm
BASE_INCLUDE=systemd,systemd-sysv,udev,dbus,kmod,linux-image-amd64,initramfs-tools,iproute2,procps,ca-certificates,sudo,curl,python3,less,netbase,e2fsprogs
DESKTOP_PACKAGES=(
    xserver-xorg-core xserver-xorg-input-libinput xinit x11-xserver-utils x11-utils xauth
    xfce4-session xfwm4 xfdesktop4 xfce4-panel xfce4-settings xfconf thunar xfce4-terminal
    mousepad chromium dbus-x11 at-spi2-core fonts-dejavu-core adwaita-icon-theme
    xdotool scrot x11vnc novnc python3-websockify net-tools xvfb xdg-utils
)

log() { printf 'build-vm-images: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $EUID -eq 0 ]] || die "must run as root"
# shellcheck source=scripts/lib-debootstrap.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib-debootstrap.sh"

in_root() { # run a command in the image's root with /proc, /sys and /dev mounted
    local root=$1
    shift
    mount -t proc proc "$root/proc"
    mount -t sysfs sys "$root/sys"
    mount --bind /dev "$root/dev"
    local rc=0
    DEBIAN_FRONTEND=noninteractive chroot "$root" "$@" || rc=$?
    umount "$root/dev" "$root/sys" "$root/proc"
    return $rc
}

# --------------------------------------------------------------------------- recipes
configure_base() {
    local root=$1
    # The root disk is the first virtio disk; a bigger sandbox disk than the image grows the
    # filesystem at boot (systemd-growfs). The toolkit disk is found by its serial.
    cat >"$root/etc/fstab" <<'EOF'
/dev/vda / ext4 rw,noatime,discard,x-systemd.growfs 0 1
/dev/disk/by-id/virtio-tk /.dsec erofs ro,nofail,x-systemd.device-timeout=30s 0 0
EOF
    mkdir -p "$root/.dsec"
    cat >"$root/etc/systemd/system/dsec-aether.service" <<'EOF'
[Unit]
Description=dsec in-sandbox agent (aether) on the virtio-serial port dsec.aether
RequiresMountsFor=/.dsec
Requires=dev-virtio\x2dports-dsec.aether.device
After=dev-virtio\x2dports-dsec.aether.device
DefaultDependencies=no

[Service]
Type=simple
Environment=DSEC_AETHER_CHANNEL_DEVICE=/dev/virtio-ports/dsec.aether DSEC_AETHER_GUEST=1 DSEC_AETHER_WARM=1 DSEC_AETHER_SERVICE=1
Environment=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
ExecStart=/.dsec/lib/ld-linux-x86-64.so.2 --inhibit-cache --library-path /.dsec/lib /.dsec/bin/python3.11 -I -S -B -m aether
# What aether tells the host (its counters, a full disk) goes to the serial console too, where
# the edge reads it, as a microVM's aether (pid 1 there) writes it.
StandardOutput=journal+console
StandardError=journal+console
# aether's commands are the sandbox: systemd must not kill them when aether ends.
KillMode=process
Restart=no
OOMScoreAdjust=-900

[Install]
WantedBy=multi-user.target
EOF
    chroot "$root" systemctl enable dsec-aether.service >/dev/null 2>&1
    # Nothing wakes up on its own under emulation: no timers, no getty, no network manager.
    for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer \
        man-db.timer dpkg-db-backup.timer systemd-tmpfiles-clean.timer getty@tty1.service \
        serial-getty@ttyS0.service systemd-networkd.service systemd-timesyncd.service \
        systemd-resolved.service e2scrub_reap.service; do
        ln -sfn /dev/null "$root/etc/systemd/system/$unit"
    done
    echo "NAutoVTs=0" >>"$root/etc/systemd/logind.conf"
    mkdir -p "$root/etc/systemd/journald.conf.d"
    printf '[Journal]\nStorage=volatile\nRuntimeMaxUse=16M\n' >"$root/etc/systemd/journald.conf.d/dsec.conf"
    # E2B's user model: commands may run as "user" (home /home/user) with sudo.
    chroot "$root" useradd -m -u 1000 -s /bin/bash -G sudo user
    echo 'user ALL=(ALL) NOPASSWD:ALL' >"$root/etc/sudoers.d/user"
    chmod 440 "$root/etc/sudoers.d/user"
    chroot "$root" passwd -l root >/dev/null
    : >"$root/etc/resolv.conf"
    echo sandbox >"$root/etc/hostname"
    printf '127.0.0.1\tlocalhost\n::1\tlocalhost\n' >"$root/etc/hosts"
    mkdir -p "$root/work" # the working directory dsec's images have
    # Only what a virtio guest needs in the initramfs: boots faster than "most".
    sed -i 's/^MODULES=.*/MODULES=list/' "$root/etc/initramfs-tools/initramfs.conf"
    printf '%s\n' virtio_pci virtio_blk virtio_net virtio_console ext4 erofs >>"$root/etc/initramfs-tools/modules"
    in_root "$root" update-initramfs -u -k all >/dev/null 2>&1 || die "update-initramfs failed"
}

build_bookworm_root() {
    local root=$1 mirror
    mirror=$(detect_mirror)
    log "debootstrap $BOOKWORM_SUITE (systemd, kernel) from $mirror (takes a few minutes)"
    debootstrap --variant=minbase --include="$BASE_INCLUDE" \
        "$BOOKWORM_SUITE" "$root" "$mirror" >"$root.debootstrap.log" 2>&1 || {
        tail -n 30 "$root.debootstrap.log" >&2
        die "debootstrap failed (log above)"
    }
    configure_base "$root"
    clean_root "$root"
}

build_desktop_root() {
    local root=$1
    [[ -d $IMAGE_DIR/.bookworm.root ]] || die "the desktop image builds on bookworm's root: build bookworm first"
    cp -a "$IMAGE_DIR/.bookworm.root" "$root"
    log "installing the desktop (${#DESKTOP_PACKAGES[@]} packages, takes a few minutes)"
    # With this host's resolver and apt sources (bookworm, its updates and security: Chromium
    # comes from there), removed again before the image is made.
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    mkdir -p "$root/etc/apt/sources.list.d"
    cp /etc/apt/sources.list.d/*.sources "$root/etc/apt/sources.list.d/" 2>/dev/null || true
    in_root "$root" apt-get update -qq >"$root.apt.log" 2>&1 ||
        { tail -n 30 "$root.apt.log" >&2; die "apt-get update failed"; }
    in_root "$root" apt-get install -y -qq --no-install-recommends "${DESKTOP_PACKAGES[@]}" \
        >>"$root.apt.log" 2>&1 || { tail -n 30 "$root.apt.log" >&2; die "apt-get install failed"; }
    rm -f "$root"/etc/apt/sources.list.d/*.sources
    # The e2b-desktop SDK runs noVNC from /opt/noVNC (utils/novnc_proxy).
    ln -sfn /usr/share/novnc "$root/opt/noVNC"
    # Xorg as root on the VM's display (:0, no access control: the display is reachable only
    # inside the guest), never blanking; the Xfce session as "user".
    cat >"$root/etc/systemd/system/dsec-xorg.service" <<'EOF'
[Unit]
Description=Xorg on the VM's display (:0)
After=systemd-user-sessions.service

[Service]
ExecStart=/usr/lib/xorg/Xorg :0 -ac -nolisten tcp -s 0 -dpms -novtswitch -keeptty -r vt7
Restart=always

[Install]
WantedBy=graphical.target
EOF
    cat >"$root/etc/systemd/system/dsec-desktop.service" <<'EOF'
[Unit]
Description=The Xfce session of user "user" on :0
Requires=dsec-xorg.service
After=dsec-xorg.service

[Service]
User=user
WorkingDirectory=/home/user
Environment=DISPLAY=:0 HOME=/home/user
ExecStartPre=/bin/sh -c 'for i in $(seq 100); do [ -e /tmp/.X11-unix/X0 ] && exit 0; sleep 0.2; done; exit 1'
ExecStart=/usr/bin/dbus-launch --exit-with-session /usr/bin/startxfce4
Restart=always

[Install]
WantedBy=graphical.target
EOF
    # "The desktop is up" on the serial console once the panel and the desktop are mapped
    # (a running process is not yet a window: under TCG they map tens of seconds later). The
    # edge then waits for the screen to be drawn and still, and only then saves a template.
    cat >"$root/etc/systemd/system/dsec-desktop-ready.service" <<'EOF'
[Unit]
Description=Tell the host (serial console) when the Xfce desktop is up
After=dsec-desktop.service
Requires=dsec-desktop.service

[Service]
Type=oneshot
ExecStart=/bin/sh -c 'export DISPLAY=:0; until xdotool search --onlyvisible --class xfce4-panel && xdotool search --onlyvisible --class xfdesktop; do sleep 0.5; done >/dev/null 2>&1; echo DSEC-DESKTOP-READY >/dev/ttyS0'

[Install]
WantedBy=graphical.target
EOF
    chroot "$root" systemctl enable dsec-xorg.service dsec-desktop.service dsec-desktop-ready.service \
        >/dev/null 2>&1
    chroot "$root" systemctl set-default graphical.target >/dev/null 2>&1
    printf 'allowed_users=anybody\n' >"$root/etc/X11/Xwrapper.config"
    # The screen is 1024x768 (e2b-desktop's default): the VGA's preferred mode is 1280x800.
    mkdir -p "$root/etc/X11/xorg.conf.d"
    cat >"$root/etc/X11/xorg.conf.d/10-dsec-screen.conf" <<'EOF'
Section "Monitor"
    Identifier "Virtual-1"
    Option "PreferredMode" "1024x768"
EndSection
Section "ServerFlags"
    Option "BlankTime" "0"
    Option "StandbyTime" "0"
    Option "SuspendTime" "0"
    Option "OffTime" "0"
EndSection
EOF
    # No key autorepeat (Xorg -r above, and Xfce's settings daemon, which would turn it back
    # on): an agent's keys are discrete presses, and under TCG on a busy host a key's release
    # can reach X later than the repeat delay, which typed "hellooo" for "hello".
    mkdir -p "$root/etc/xdg/xfce4/xfconf/xfce-perchannel-xml"
    cat >"$root/etc/xdg/xfce4/xfconf/xfce-perchannel-xml/keyboards.xml" <<'EOF'
<?xml version="1.0" encoding="UTF-8"?>
<channel name="keyboards" version="1.0">
  <property name="Default" type="empty">
    <property name="KeyRepeat" type="bool" value="false"/>
  </property>
</channel>
EOF
    # Chromium runs as root in the sandbox when an agent asks: no sandbox, no first-run.
    mkdir -p "$root/etc/chromium.d"
    echo 'export CHROMIUM_FLAGS="$CHROMIUM_FLAGS --no-first-run --disable-background-networking --password-store=basic"' \
        >"$root/etc/chromium.d/dsec"
    clean_root "$root"
}

clean_root() {
    local root=$1
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/cache/apt/archives/partial/* \
        "$root"/var/cache/apt/*.bin "$root"/var/lib/apt/lists/*
    mkdir -p "$root/var/lib/apt/lists/partial"
    : >"$root/etc/machine-id" # systemd makes one per boot
}

recipe() {
    printf 'recipe-version=%s\nsuite=%s\ninclude=%s\ndesktop=%s\n' "$RECIPE_VERSION" \
        "$BOOKWORM_SUITE" "$BASE_INCLUDE" "${DESKTOP_PACKAGES[*]}"
    declare -f configure_base build_bookworm_root build_desktop_root clean_root make_disk
}

# --------------------------------------------------------------------------- disk
make_disk() { # root dir -> out dir with disk.qcow2, vmlinuz, initrd.img, image.json
    local name=$1 root=$2 out=$3 display=$4 used size kernel release
    kernel=$(ls "$root"/boot/vmlinuz-* | sort -V | tail -n1)
    release=${kernel##*/vmlinuz-}
    cp "$kernel" "$out/vmlinuz"
    cp "$root/boot/initrd.img-$release" "$out/initrd.img"
    used=$(du -sm --apparent-size "$root" | cut -f1)
    size=$(((used * 13 / 10 + 512) / 256 * 256)) # MB: 30% free + 512 MB, whole 256 MB
    # -m 0: no blocks reserved for root (the sandbox's commands run as root: a disk is full
    # when it is full, not 5% earlier for everyone else).
    mkfs.ext4 -q -m 0 -L dsecroot -d "$root" -E lazy_itable_init=0 "$out/root.img" "${size}M" >/dev/null
    qemu-img convert -O qcow2 "$out/root.img" "$out/disk.qcow2"
    rm -f "$out/root.img"
    printf '{"name": "%s", "kernel_release": "%s", "root_mb": %d, "display": %s, "recipe": "%s", "built": %d}\n' \
        "$name" "$release" "$size" "$display" "$(recipe | sha256sum | cut -c1-16)" "$(date +%s)" \
        >"$out/image.json"
}

build_image() {
    local name=$1 t0 want tmp status=cached display=false
    t0=$(date +%s)
    want=$(recipe | sha256sum | cut -c1-16)
    [[ $name == desktop ]] && display=true
    if [[ ${FORCE:-0} == 1 || ! -f $IMAGE_DIR/$name/image.json ]] ||
        ! grep -q "\"recipe\": \"$want\"" "$IMAGE_DIR/$name/image.json"; then
        status=built
        tmp=$(mktemp -d "$IMAGE_DIR/.$name.tmp.XXXXXX")
        TMPDIRS+=("$tmp")
        "build_${name}_root" "$tmp/root"
        mkdir "$tmp/out"
        make_disk "$name" "$tmp/root" "$tmp/out" "$display"
        # The bookworm root stays: the desktop image is built on it.
        if [[ $name == bookworm ]]; then
            rm -rf "$IMAGE_DIR/.bookworm.root"
            mv "$tmp/root" "$IMAGE_DIR/.bookworm.root"
        fi
        # Install: a running sandbox's overlay keeps its old backing file open.
        [[ -d $IMAGE_DIR/$name ]] && mv "$IMAGE_DIR/$name" "$tmp/old"
        mv "$tmp/out" "$IMAGE_DIR/$name"
    fi
    printf '%-9s %-6s qcow2 %s  %ds\n' "$name" "$status" \
        "$(du -h "$IMAGE_DIR/$name/disk.qcow2" | cut -f1)" "$(($(date +%s) - t0))"
}

# --------------------------------------------------------------------------- main
images=("$@")
[[ ${#images[@]} -gt 0 ]] || images=("${ALL_IMAGES[@]}")
for name in "${images[@]}"; do
    declare -F "build_${name}_root" >/dev/null || die "unknown image '$name' (known: ${ALL_IMAGES[*]})"
done
mkdir -p "$IMAGE_DIR"
exec 9>"$IMAGE_DIR/.lock"
flock 9
for name in "${images[@]}"; do
    build_image "$name"
done
