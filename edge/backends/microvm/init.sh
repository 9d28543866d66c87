#!/bin/busybox sh
# dsec microVM guest init (pid 1 of the initramfs; edge/backends/microvm/guest.py builds it).
#
# Disks are found by their virtio-blk serial, never by probe order:
#   l0, l1, ...  the image's EROFS layers, top-most first (overlayfs order), read-only
#   b<i>         the data blob of chunked layer i (mounted with -o device=)
#   tk           the toolkit (aether, chronus, their Python), mounted at /.dsec
#   rw           the sandbox's writable ext4 disk: overlay upper and work dirs
# Then aether becomes pid 1 of the composed root (switch_root) and talks to the edge over the
# virtio-serial port named dsec.aether. Any failure here is printed as "DSEC-INIT: FATAL ..."
# on the serial console and ends the guest (pid 1 exits: panic, and QEMU runs with -no-reboot).
/bin/busybox mkdir -p /proc /sys /dev /bin /sbin
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev

fatal() { echo "DSEC-INIT: FATAL $*" > /dev/ttyS0; sleep 0.2; exit 1; }

# The edge's accelerator probe (edge/backends/microvm/accel.py): the kernel booted, that is all.
if grep -q dsec.probe /proc/cmdline; then echo DSEC-PROBE-OK > /dev/ttyS0; poweroff -f; fi

# A guest out of memory must OOM-kill, not thrash: with no swap, the kernel would evict the
# page cache of the very programs running (aether, the shell) and crawl for minutes. MGLRU's
# min_ttl_ms keeps the last second's working set and calls the OOM killer instead.
echo y > /sys/kernel/mm/lru_gen/enabled 2>/dev/null
echo 1000 > /sys/kernel/mm/lru_gen/min_ttl_ms 2>/dev/null

for m in $(cat /modules.order); do
  insmod "/mod/$m.ko" 2>/dev/null || [ -d "/sys/module/$m" ] || fatal "insmod $m failed"
done

# Disks appear asynchronously after the driver loads: wait for the writable one (up to ~5 s).
i=0
until [ -n "$(grep -lx rw /sys/block/vd*/serial 2>/dev/null)" ]; do
  i=$((i + 1)); [ $i -gt 500 ] && fatal "no disk with serial rw"
  sleep 0.01
done
dev() { f=$(grep -lx "$1" /sys/block/vd*/serial 2>/dev/null | head -n1); [ -n "$f" ] && f=${f%/serial} && echo "/dev/${f##*/}"; }

mkdir -p /layers /rw /newroot
lowers=""
i=0
while d=$(dev "l$i"); do
  mkdir -p "/layers/$i"
  opts=ro
  b=$(dev "b$i") && opts="ro,device=$b"
  mount -t erofs -o "$opts" "$d" "/layers/$i" || fatal "mount layer $i ($d)"
  lowers="${lowers:+$lowers:}/layers/$i"
  i=$((i + 1))
done
[ -n "$lowers" ] || fatal "no image layers"
mount -t ext4 -o noatime,discard "$(dev rw)" /rw || fatal "mount the writable disk"
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o "lowerdir=$lowers,upperdir=/rw/upper,workdir=/rw/work" /newroot \
  || fatal "mount the overlay"
mkdir -p /newroot/.dsec /newroot/proc /newroot/sys /newroot/dev /newroot/tmp /newroot/run
mount -t erofs -o ro "$(dev tk)" /newroot/.dsec || fatal "mount the toolkit"
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev shm /newroot/dev/shm
mount -t tmpfs -o mode=755,nosuid,nodev run /newroot/run
mount -t cgroup2 cgroup2 /newroot/sys/fs/cgroup 2>/dev/null || true
[ -e /newroot/dev/ptmx ] || ln -s pts/ptmx /newroot/dev/ptmx

port=""
for n in /newroot/sys/class/virtio-ports/*/name; do
  [ "$(cat "$n" 2>/dev/null)" = dsec.aether ] && p=${n%/name} && port="/dev/${p##*/}"
done
[ -n "$port" ] || fatal "no virtio-serial port named dsec.aether"

echo "DSEC-INIT: root composed ($i layers), aether on $port" > /newroot/dev/ttyS0
exec env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  LANG=C.UTF-8 DSEC_AETHER_CHANNEL_DEVICE="$port" DSEC_AETHER_WARM=1 DSEC_AETHER_GUEST=1 \
  switch_root /newroot /.dsec/lib/ld-linux-x86-64.so.2 --inhibit-cache --library-path /.dsec/lib \
  /.dsec/bin/python3.11 -I -S -B -m aether
