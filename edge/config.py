"""Edge configuration (DSEC_EDGE_*)."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ConfigError, ServiceConfig
from edge import hostfacts
from edge.fncall.environments import FnCallSettings, environments, parse_pools
from edge.model import EDGE_ID

#: The smallest writable-layer limit (an ext4 image smaller than this has no room to work).
MIN_DISK_MB = 16
#: Why DSEC_EDGE_MICROVM_PMEM cannot be on (measured on QEMU 7.2 with the microvm machine,
#: pcie=on, virtio-pmem-pci; docs/ARCHITECTURE.md "Guest memory" has the command lines).
PMEM_UNAVAILABLE = (
    "DSEC_EDGE_MICROVM_PMEM=true cannot work: QEMU's microvm machine hands only CPUs to its "
    "hotplug handler, so a virtio-pmem-pci device (accepted with pcie=on) is never given "
    "device memory: QEMU starts, and the guest's nd_pmem says 'could not reserve region "
    "[mem 0x00000000-...]'; with memaddr= set by hand /dev/pmem0 appears but its memory is "
    "never mapped (info mtree shows no region) and EROFS finds no superblock on it. The "
    "layers stay on virtio-blk"
)


def _total_memory_mb() -> int:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 4096


@dataclass(frozen=True)
class EdgeConfig(ServiceConfig):
    listen: str = "127.0.0.1:7110"
    #: Node identity, [a-z0-9]{1,16}; encoded in every sandbox id it owns.
    edge_id: str = "edge0"
    #: Address others use to reach this edge ("" = the bound listen address).
    advertise: str = ""
    #: Where records, bundles and writable layers live.
    state_dir: Path = Path("/var/lib/dsec/edge")
    #: "container" (runc) or "null" (tracks sandboxes, starts nothing: tests and benchmarks).
    runtime: str = "container"
    #: Physical capacity offered; 0 = measured from this machine.
    cpu_millis: int = 0
    memory_mb: int = 0
    #: Overcommit ratios applied to the capacity at admission (sandboxes mostly wait on the model).
    #: CPU: the report finds 90% of sandboxes use <= 5% of the CPU they ask for, so 16x requests
    #: still average ~80% of the cores (16 x 5%); CPU is compressible (contention costs latency,
    #: which best-effort SCHED_IDLE bounds), and a 2-core node admits 32 sandboxes of cpu=1.
    cpu_overcommit: float = 16.0
    #: Memory is not compressible (an overcommitted node OOMs): 1.5x of RAM in limits, as idle
    #: sandboxes use a few MB of their limit; 24 GiB admits ~70 sandboxes of memory_mb=512.
    memory_overcommit: float = 1.5
    #: The report runs 3,200 per node; 1,000 idle busybox sandboxes are measured on 2 cores
    #: (bench/bench_density.py).
    max_sandboxes: int = 1000
    #: Whole GPUs advertised to placement. No sandbox backend attaches GPUs yet (a create asking
    #: for some is refused: BACKEND_CAPABILITY gpus); FnCall's GPU pools find theirs themselves.
    gpus: int = 0
    #: Labels placement can select on, e.g. "location=cloud,zone=a".
    labels: dict[str, str] = field(default_factory=dict)
    #: Watcher to register with ("" = none: a standalone edge).
    watcher: str = ""
    #: IAM, told when sandboxes end so their quota is released ("" = none).
    iam: str = ""
    register_interval_s: float = 5.0
    #: Platform defaults for a sandbox that asks for nothing.
    default_ttl_s: int = 3600
    #: How long a terminated sandbox's record stays readable (its reason) before it is forgotten.
    terminated_retention_s: float = 3600.0
    #: The operation log (edge/oplog.py, <state_dir>/oplog.db): "on", or "off" for
    #: measurements only (calls are not logged, and those carrying an operation id, which
    #: the SDK's always do, are refused UNIMPLEMENTED OPERATION_LOG_OFF).
    oplog: str = "on"
    #: Per sandbox, the bytes of
    #: bodies kept (requests, output copies, responses); past it the oldest entries lose their
    #: bodies, every entry with its digests and exit status stays.
    oplog_max_mb: int = 64
    #: Of a streamed command's output, what an entry keeps per stream (head and tail), in KiB;
    #: also the largest upload whose bytes are kept for replay.
    oplog_copy_kb: int = 1024
    #: How long an ended sandbox's log is kept (readable, exportable); 0 = removed at its end.
    oplog_retention_s: float = 3600.0
    reap_interval_s: float = 1.0
    #: A sandbox paused at its TTL (SandboxSpec.pause_at_ttl) is kept this long for a resume
    #: before it ends, TTL (its disk and memory stay held meanwhile).
    paused_at_ttl_keep_s: float = 86400.0
    #: On SIGTERM: "keep" sandboxes running (re-adopted when the edge comes back,
    #: e.g. an upgrade) or "stop" them all and release every mount (a local
    #: cluster going down).
    on_shutdown: str = "keep"
    #: Base images / environments (name.erofs or name.rootfs/ per image).
    image_dir: Path = Path("/var/lib/dsec/images")
    #: Networked sandboxes (policy other than NONE): the edge's bridge, its subnet (the first
    #: address is the bridge's: gateway and DNS resolver), and where the resolver forwards
    #: ("host[:port]"; "" = the host's first resolv.conf nameserver). Bridge and subnet ""
    #: (the default): the first free of dsec0 10.231.0.0/16, dsec1 10.230.0.0/16, ...,
    #: 10.200.0.0/16 (edge.network.claims: the edges of one node never share a bridge, a
    #: subnet or a queue; configured ones are checked the same way).
    net_bridge: str = ""
    net_subnet: str = ""
    #: Node-wide: every edge's claim of its bridge, subnet and name-gate queue.
    net_claim_dir: Path = Path("/run/dsec/net")
    dns_upstream: str = ""
    dns_refresh_s: float = 60.0
    #: The name gate's NFQUEUE number: connections a policy allows only by a domain name are
    #: admitted on the name they ask for (TLS server name, HTTP Host; edge.network.namegate).
    #: One per edge; 0 = derived from the bridge's name, unused by the node's other edges.
    net_gate_queue: int = 0
    #: bpffs directory for the sandboxes' pinned eBPF maps and programs (one subdir per edge,
    #: named after its bridge: unique on the node).
    bpf_pin_dir: Path = Path("/sys/fs/bpf/dsec")
    #: Writable-layer limit of a sandbox that asks for none (resources.disk_mb 0). Every
    #: sandbox has one: a sparse ext4 image of that size (it takes only what is written).
    default_disk_mb: int = 10240
    #: The most a create may ask for (resources.disk_mb); more is INVALID_ARGUMENT.
    max_disk_mb: int = 204800
    #: Disk-limit filesystems of the default size kept made ahead of creates (a loop device and
    #: a mount each, on the host's mount table until a create takes one; edge/runtime/disk.py
    #: Pool); 0 = each create makes its own.
    disk_pool: int = 4
    #: How EROFS images (layers, the toolkit) are mounted: "file" (the image file itself, the
    #: kernel's file-backed mode, 6.12), "loop" (read-only loop devices, older kernels), "auto"
    #: (file where the kernel has it). edge/runtime/mounts.py.
    erofs_mount: str = "auto"
    #: Free space kept on every filesystem the edge writes (state, writable layers, logs):
    #: below it creates are refused (NODE_DISK_LOW) and the fastest writer is ended (DISK_QUOTA).
    disk_reserve_mb: int = 1024
    #: Size of the swap area a pause pushes a container's memory into (a swap file the edge
    #: makes in <state_dir>/swap, only if that leaves the disk reserve free; 0 = none: pause
    #: only freezes, and says so). Its pages hold paused sandboxes only: a running sandbox
    #: never swaps (memsw limit = memory limit, memory.swappiness 0).
    pause_swap_mb: int = 8192
    #: How often the free space of those filesystems is checked.
    disk_check_interval_s: float = 0.25
    #: Each sandbox's aether/chronus log is kept below this (the edge cuts it to its head).
    sandbox_log_max_kb: int = 1024
    #: Host controls the operator turns off explicitly (edge/controls.py: landlock, network,
    #: memory_swap). Every other control the edge relies on must be there, or it refuses to start.
    disabled_controls: tuple[str, ...] = ()
    #: cgroup of this edge's sandboxes (each sandbox is <parent>/<id>). It must belong to this
    #: edge alone: at start every child it does not know is removed as an orphan.
    cgroup_parent: str = "dsec"
    #: How often running sandboxes are checked (disk, pids, violations, channel).
    watch_interval_s: float = 1.0
    #: A sandbox at its pids limit this long, with forks failing, ends PIDS_EXHAUSTED.
    pids_exhausted_after_s: float = 3.0
    #: A running container sandbox's CPU, memory and disk use is sampled this often, and the
    #: samples of the last usage_keep_s are kept (GetSandboxMetrics; edge/usage.py).
    usage_sample_s: float = 5.0
    usage_keep_s: float = 600.0
    #: The layer store: content-addressed EROFS layers and named environments. A local
    #: directory on one machine; in a cluster a shared filesystem at the same path on every node.
    layer_store: Path = Path("/var/lib/dsec/store")
    #: How a layer is verified on its first use on this node: "full" (hash the whole data
    #: blob; a corrupt one is never mounted) or "sampled" (size + sampled chunks at once, the
    #: rest in the background; start time independent of the image size) or "store" (once per
    #: cluster: a node that finds the store's record of a full hash of this very blob reads
    #: none of it; see edge.layers.node).
    layer_verify: str = "full"
    #: EROFS chunk size of layers built here (power of two, >= 4 KiB).
    layer_chunk_kb: int = 1024
    #: Layer store maintenance: leases, garbage collection, background verification.
    layer_gc_interval_s: float = 300.0
    #: An unreferenced layer is removed once it has been unreferenced this long.
    layer_gc_grace_s: float = 3600.0
    #: A store that does not answer within this fails creates with UNAVAILABLE.
    layer_store_timeout_s: float = 5.0
    #: Extra pack_diff exclusions (sandbox-absolute globs) on top of the built-in residue list.
    layer_exclude: tuple[str, ...] = ()
    #: After a Docker import, collapse consecutive layers smaller than this (0 = never).
    layer_collapse_below_mb: int = 0
    #: Warm container sandboxes kept started per image, image=count, e.g. "busybox=64"
    #: ("" = none): a create that one can serve claims it instead of starting a container
    #: (edge/backends/warm.py). Each costs an idle aether (~6 MB) and is not counted in admission.
    warm_pool: dict[str, str] = field(default_factory=dict)
    #: FnCall warm pools of a container edge, environment=containers, e.g.
    #: "python=4,cpp=2,bash=2" ("" = none: the edge does not offer FNCALL).
    fncall_pools: dict[str, str] = field(
        default_factory=lambda: {"python": "4", "cpp": "2", "bash": "2"}
    )
    #: FnCall environment images, name=image: overrides a built-in one or adds an environment.
    fncall_images: dict[str, str] = field(default_factory=dict)
    #: A pool container is replaced after this many jobs (and after any anomaly).
    fncall_jobs_per_container: int = 2000
    #: CPU quota of one pool container (it runs one job at a time).
    fncall_cpu_millis: int = 1000
    #: The most memory a single job may ask for.
    fncall_max_memory_mb: int = 4096
    #: pids limit of one pool container (fork bombs stop here).
    fncall_pids_max: int = 64
    #: Job processes a pool container forks ahead, in one batch (idle spares, root until used).
    fncall_spares: int = 4
    #: How long a job may wait for a free container before the edge refuses it.
    fncall_queue_timeout_s: float = 30.0
    #: Writable-layer limit of a pool container (what jobs write outside their tmpfs dirs).
    fncall_disk_mb: int = 256
    #: MicroVMs (QEMU microvm guests) beside containers on a container edge: "auto" (offered
    #: when a guest boots at edge start; the edge says why not otherwise), "on" (the edge
    #: refuses to start without), "off".
    microvm: str = "auto"
    #: The accelerator: "auto" (KVM if a probe guest boots under it, else TCG), "kvm", "tcg".
    microvm_accel: str = "auto"
    #: The QEMU binary (e.g. a newer build of one's own).
    microvm_qemu: str = "qemu-system-x86_64"
    #: Node-wide: the guest initramfs, the accelerator probe's verdict and the templates
    #: (shared by every edge of the node).
    microvm_cache_dir: Path = Path("/var/lib/dsec/microvm")
    #: Create microVMs by restoring a per-image template snapshot (off: every create boots).
    microvm_templates: bool = True
    #: Free-page reporting (virtio-balloon): memory a guest frees goes back to the host ~2 s
    #: later. Only with templates off (and no forks of such guests): QEMU 7.2 gives back a
    #: page of a file-backed guest by punching a hole in the file, and a clone's file is its
    #: template's RAM, every clone's memory (docs/ARCHITECTURE.md, "Guest memory").
    microvm_free_page_reporting: bool = False
    #: The read-only layers and toolkit on virtio-pmem with DAX (one host page-cache copy for
    #: every guest): cannot work on QEMU's microvm machine, which never maps a virtio-pmem
    #: device's memory; true refuses to start, saying so.
    microvm_pmem: bool = False
    #: Warm microVMs kept restored per image, image=count (e.g. "busybox=4"): a create of the
    #: default shape claims one instead of restoring (~0.1 s instead of ~0.5 s under TCG).
    microvm_warm_pool: dict[str, str] = field(default_factory=dict)
    #: The warm guests' RAM (their shape: 1 vCPU, this, the default disk); 512 is what a create
    #: that asks for nothing gets.
    microvm_warm_memory_mb: int = 512
    #: Templates kept per node (least recently used ones are removed beyond this).
    microvm_max_templates: int = 8
    #: Guest RAM bounds (MB): below the minimum the guest's kernel and aether do not fit.
    microvm_min_memory_mb: int = 256
    microvm_max_memory_mb: int = 16384
    #: vCPUs per guest at most (0 = the host's cores).
    microvm_max_vcpus: int = 0
    #: The QEMU process's own memory (device model, TCG code cache) on top of guest RAM, in its
    #: memory cgroup limit.
    microvm_overhead_mb: int = 192
    #: Full VMs (libvirt + QEMU q35, edge/backends/vm): "auto" (offered when libvirtd answers,
    #: VM images exist and a guest kernel boots; the edge says why not otherwise), "on" (the
    #: edge refuses to start without), "off".
    vm: str = "auto"
    #: The accelerator: "auto" (KVM if a probe guest boots under it, else TCG), "kvm", "tcg".
    vm_accel: str = "auto"
    #: libvirt's URI (the system QEMU driver: domains outlive the edge).
    vm_uri: str = "qemu:///system"
    #: The VM images (scripts/build-vm-images.sh writes them here).
    vm_image_dir: Path = Path("/var/lib/dsec/vm-images")
    #: Node-wide: the accelerator probe's verdict and the templates.
    vm_cache_dir: Path = Path("/var/lib/dsec/vm")
    #: The VMs' agent, console and VNC sockets (a short path: a socket path has 108 bytes).
    vm_socket_dir: Path = Path("/run/dsec-vm")
    #: Create VMs by restoring a saved, booted template per image and shape (off: every
    #: create boots: tens of seconds under TCG, minutes for a desktop).
    vm_templates: bool = True
    #: Templates kept per node (each holds a saved guest: its memory and disk).
    vm_max_templates: int = 4
    #: Guest RAM bounds (MB): below the minimum systemd and aether do not fit.
    vm_min_memory_mb: int = 512
    vm_max_memory_mb: int = 16384
    #: vCPUs per guest at most (0 = the host's cores).
    vm_max_vcpus: int = 0
    #: QEMU's own memory on top of guest RAM (the domain's hard limit).
    vm_overhead_mb: int = 256
    #: How long a guest may take to boot to aether (and a desktop to its session) when a
    #: template is built or a create boots cold; a TCG desktop takes minutes.
    vm_ready_timeout_s: float = 900.0

    def validate(self) -> None:
        super().validate()
        if not 1 <= self.paused_at_ttl_keep_s <= 30 * 86400:
            raise ConfigError(
                f"DSEC_EDGE_PAUSED_AT_TTL_KEEP_S={self.paused_at_ttl_keep_s:g} must be between "
                "1 and 2592000 (30 days)"
            )
        if not self.watch_interval_s <= self.usage_sample_s <= 3600:
            raise ConfigError(
                f"DSEC_EDGE_USAGE_SAMPLE_S={self.usage_sample_s:g} must be between "
                f"DSEC_EDGE_WATCH_INTERVAL_S ({self.watch_interval_s:g}) and 3600"
            )
        if not self.usage_sample_s <= self.usage_keep_s <= 7 * 86400:
            raise ConfigError(
                f"DSEC_EDGE_USAGE_KEEP_S={self.usage_keep_s:g} must be between "
                "DSEC_EDGE_USAGE_SAMPLE_S and 604800 (a week)"
            )
        if not EDGE_ID.match(self.edge_id):
            raise ConfigError(
                f'DSEC_EDGE_EDGE_ID={self.edge_id!r} must match [a-z0-9]{{1,16}} and not be "queued" (reserved)'
            )
        if self.runtime not in ("container", "null"):
            raise ConfigError(f"DSEC_EDGE_RUNTIME={self.runtime!r}: expected container or null")
        for image, count in {**self.warm_pool, **self.microvm_warm_pool}.items():
            if not count.isdigit():
                raise ConfigError(
                    f"DSEC_EDGE_WARM_POOL: {image}={count!r}: the count must be a whole number"
                )
        if self.on_shutdown not in ("keep", "stop"):
            raise ConfigError(f"DSEC_EDGE_ON_SHUTDOWN={self.on_shutdown!r}: expected keep or stop")
        if self.cpu_overcommit < 1 or self.memory_overcommit < 1:
            raise ConfigError("overcommit ratios must be >= 1")
        if self.max_sandboxes < 1:
            raise ConfigError("DSEC_EDGE_MAX_SANDBOXES must be >= 1")
        if self.net_subnet:
            try:
                net = ipaddress.IPv4Network(self.net_subnet)
            except ValueError as exc:
                raise ConfigError(f"DSEC_EDGE_NET_SUBNET={self.net_subnet!r}: {exc}") from None
            if net.num_addresses < 4:
                raise ConfigError(f"DSEC_EDGE_NET_SUBNET={self.net_subnet!r} is too small")
        if len(self.net_bridge) > 15:
            raise ConfigError(
                f"DSEC_EDGE_NET_BRIDGE={self.net_bridge!r}: at most 15 characters ('' = chosen)"
            )
        if not MIN_DISK_MB <= self.default_disk_mb <= self.max_disk_mb:
            raise ConfigError(
                f"DSEC_EDGE_DEFAULT_DISK_MB={self.default_disk_mb}: every sandbox has a disk "
                f"limit; expected {MIN_DISK_MB}..DSEC_EDGE_MAX_DISK_MB ({self.max_disk_mb})"
            )
        if self.pause_swap_mb < 0:
            raise ConfigError("pause_swap_mb must be >= 0 (0 = no swap area: pause freezes only)")
        if self.erofs_mount not in hostfacts.EROFS_MODES:
            raise ConfigError(
                f"DSEC_EDGE_EROFS_MOUNT={self.erofs_mount!r}: expected auto, file or loop"
            )
        if not 0 <= self.disk_pool <= 256:
            raise ValueError(f"DSEC_EDGE_DISK_POOL={self.disk_pool}: expected 0..256")
        if self.disk_reserve_mb < 0 or self.disk_check_interval_s <= 0:
            raise ConfigError("DSEC_EDGE_DISK_RESERVE_MB must be >= 0, the check interval > 0")
        if self.sandbox_log_max_kb < 64:
            raise ConfigError("DSEC_EDGE_SANDBOX_LOG_MAX_KB must be >= 64")
        if self.oplog not in ("on", "off"):
            raise ConfigError(f"DSEC_EDGE_OPLOG={self.oplog!r}: expected on or off")
        if self.oplog_max_mb < 1 or self.oplog_copy_kb < 1 or self.oplog_retention_s < 0:
            raise ConfigError(
                "DSEC_EDGE_OPLOG_MAX_MB and DSEC_EDGE_OPLOG_COPY_KB must be >= 1, "
                "DSEC_EDGE_OPLOG_RETENTION_S >= 0"
            )
        if self.layer_verify not in ("full", "sampled", "store"):
            raise ConfigError(
                f"DSEC_EDGE_LAYER_VERIFY={self.layer_verify!r}: expected full, sampled or store"
            )
        kb = self.layer_chunk_kb
        if kb < 4 or kb & (kb - 1):
            raise ConfigError(f"DSEC_EDGE_LAYER_CHUNK_KB={kb}: expected a power of two >= 4")
        if self.layer_gc_interval_s <= 0 or self.layer_gc_grace_s < 0:
            raise ConfigError("DSEC_EDGE_LAYER_GC_INTERVAL_S must be > 0, the grace >= 0")
        if self.microvm not in ("auto", "on", "off"):
            raise ConfigError(f"DSEC_EDGE_MICROVM={self.microvm!r}: expected auto, on or off")
        if self.microvm_accel not in ("auto", "kvm", "tcg"):
            raise ConfigError(
                f"DSEC_EDGE_MICROVM_ACCEL={self.microvm_accel!r}: expected auto, kvm or tcg"
            )
        if self.microvm != "off":
            self._check_microvm_memory()
        if self.vm not in ("auto", "on", "off"):
            raise ConfigError(f"DSEC_EDGE_VM={self.vm!r}: expected auto, on or off")
        if self.vm_accel not in ("auto", "kvm", "tcg"):
            raise ConfigError(f"DSEC_EDGE_VM_ACCEL={self.vm_accel!r}: expected auto, kvm or tcg")
        if not 256 <= self.vm_min_memory_mb <= self.vm_max_memory_mb:
            raise ConfigError("DSEC_EDGE_VM_MIN_MEMORY_MB must be >= 256 and <= the maximum")
        if not 64 <= self.microvm_min_memory_mb <= self.microvm_max_memory_mb:
            raise ConfigError("DSEC_EDGE_MICROVM_MIN_MEMORY_MB must be >= 64 and <= the maximum")
        try:
            self.fncall_settings()
        except ValueError as exc:
            raise ConfigError(f"DSEC_EDGE_FNCALL_*: {exc}") from None

    def _check_microvm_memory(self) -> None:
        if self.microvm_pmem:
            raise ConfigError(PMEM_UNAVAILABLE)
        if self.microvm_free_page_reporting and self.microvm_templates:
            raise ConfigError(
                "DSEC_EDGE_MICROVM_FREE_PAGE_REPORTING=true needs DSEC_EDGE_MICROVM_TEMPLATES="
                "false: a template clone maps its template's RAM file copy-on-write, and QEMU "
                "7.2 returns a page the guest reports free by punching a hole in that file "
                "(ram_block_discard_range fallocates any file-backed RAM, MAP_PRIVATE or not), "
                "zeroing it under every other clone of the template"
            )

    def fncall_settings(self) -> FnCallSettings:
        """The FnCall pools' settings (raises ValueError on a bad value)."""
        pools = parse_pools(self.fncall_pools)
        envs = environments(self.fncall_images)
        if self.fncall_cpu_millis < 100 or self.fncall_max_memory_mb < 64:
            raise ValueError("fncall_cpu_millis must be >= 100 and fncall_max_memory_mb >= 64")
        if self.fncall_pids_max < 8 or self.fncall_jobs_per_container < 1:
            raise ValueError("fncall_pids_max must be >= 8 and fncall_jobs_per_container >= 1")
        if self.fncall_disk_mb < MIN_DISK_MB:
            raise ValueError(f"fncall_disk_mb={self.fncall_disk_mb} must be >= {MIN_DISK_MB}")
        if not 1 <= self.fncall_spares <= 32:
            raise ValueError(f"fncall_spares={self.fncall_spares} must be in 1..32")
        return FnCallSettings(
            pools=pools,
            environments=envs,
            jobs_per_container=self.fncall_jobs_per_container,
            cpu_millis=self.fncall_cpu_millis,
            max_memory_mb=self.fncall_max_memory_mb,
            pids_max=self.fncall_pids_max,
            spares=self.fncall_spares,
            queue_timeout_s=self.fncall_queue_timeout_s,
            disk_mb=self.fncall_disk_mb,
        )

    def effective_cpu_millis(self) -> int:
        return int((self.cpu_millis or (os.cpu_count() or 1) * 1000) * self.cpu_overcommit)

    def effective_memory_mb(self) -> int:
        return int((self.memory_mb or _total_memory_mb()) * self.memory_overcommit)

    @property
    def hostname(self) -> str:
        return socket.gethostname()
