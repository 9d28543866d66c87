# Shared by scripts/build-base-images.sh and scripts/build-vm-images.sh (sourced; needs log,
# die and BOOKWORM_SUITE from the caller).
#
# TMPDIRS: directories removed at exit, after unmounting whatever debootstrap or a chroot left
# mounted below them. detect_mirror: the Debian mirror apt uses here.

# --------------------------------------------------------------------------- cleanup
TMPDIRS=()
cleanup_tmp() {
    local d mnt
    for d in "${TMPDIRS[@]}"; do
        [[ -d $d ]] || continue
        # debootstrap mounts /proc, /sys (and sometimes /dev) inside its target; a failed run can
        # leave them mounted. Unmount everything below $d, deepest first, before deleting.
        while read -r mnt; do
            umount -l "$mnt" 2>/dev/null || log "warning: could not unmount $mnt"
        done < <(awk -v p="$d/" 'index($5, p) == 1 { print $5 }' /proc/self/mountinfo | sort -r)
        rm -rf --one-file-system "$d" || log "warning: could not remove $d"
    done
}
trap cleanup_tmp EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# --------------------------------------------------------------------------- mirror
# The Debian mirror apt uses for $BOOKWORM_SUITE: one-line sources (sources.list, *.list) first,
# then deb822 (*.sources). Only files apt itself reads; commented and disabled entries are ignored.
detect_mirror() {
    if [[ -n ${DSEC_DEBIAN_MIRROR:-} ]]; then
        echo "$DSEC_DEBIAN_MIRROR"
        return
    fi
    local f m
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f $f ]] || continue
        m=$(awk -v suite="$BOOKWORM_SUITE" '
            $1 == "deb" {
                i = 2
                if ($2 ~ /^\[/) { while (i < NF && $i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite && $i ~ /^https?:\/\//) { print $i; exit }
            }' "$f")
        if [[ -n $m ]]; then echo "$m"; return; fi
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] || continue
        m=$(awk -v suite="$BOOKWORM_SUITE" '
            function check() {
                if (found) return
                if (f["types"] ~ /(^| )deb( |$)/ && f["enabled"] !~ /^no/ &&
                    (" " f["suites"] " ") ~ (" " suite " ")) {
                    n = split(f["uris"], u, " ")
                    for (k = 1; k <= n; k++) if (u[k] ~ /^https?:\/\//) { print u[k]; found = 1; exit }
                }
                delete f
            }
            /^#/ { next }
            /^[ \t]*$/ { check(); next }
            /^[A-Za-z0-9-]+:/ {
                key = tolower(substr($0, 1, index($0, ":") - 1))
                f[key] = substr($0, index($0, ":") + 1)
                gsub(/[ \t]+/, " ", f[key]); sub(/^ /, "", f[key]); sub(/ $/, "", f[key])
                next
            }
            /^[ \t]/ { v = $0; gsub(/[ \t]+/, " ", v); f[key] = f[key] v; next }
            END { check() }' "$f")
        if [[ -n $m ]]; then echo "$m"; return; fi
    done
    echo "http://deb.debian.org/debian"
}
