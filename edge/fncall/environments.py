"""FnCall environments (what a pool's containers are made of) and the edge's pool settings."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ENV_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,23}$")
GPU_MODES = ("", "shared", "exclusive")


@dataclass(frozen=True)
class Environment:
    name: str
    #: Image name as the edge's ImageResolver knows it (<image_dir>/<image>.erofs).
    image: str
    #: Modules the warm interpreter imports once, before any job forks from it.
    preload: tuple[str, ...] = ()
    #: The image's Python that runs the runner (and, forked, every Python job).
    interpreter: str = "/usr/bin/python3"
    #: "" (no GPU), "shared" (several containers per GPU) or "exclusive" (one per GPU).
    gpu: str = ""


BUILTIN: dict[str, Environment] = {
    "python": Environment("python", "python", preload=("numpy",)),
    "cpp": Environment("cpp", "bookworm"),
    "bash": Environment("bash", "bookworm"),
    "python-gpu": Environment("python-gpu", "python", preload=("numpy",), gpu="shared"),
    "python-gpu-exclusive": Environment(
        "python-gpu-exclusive", "python", preload=("numpy",), gpu="exclusive"
    ),
}

#: Environment for every job: enough for compilers and scripts, nothing of the host's.
JOB_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/job",
    "LANG": "C.UTF-8",
    "TMPDIR": "/tmp",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclass(frozen=True)
class FnCallSettings:
    """The edge's FnCall configuration (from DSEC_EDGE_FNCALL_*)."""

    pools: dict[str, int] = field(default_factory=dict)  # environment -> containers
    environments: dict[str, Environment] = field(default_factory=lambda: dict(BUILTIN))
    #: A container is replaced after this many jobs (and after any anomaly).
    jobs_per_container: int = 2000
    #: CPU quota of one pool container (one job at a time runs in it).
    cpu_millis: int = 1000
    #: The most memory one job may ask for.
    max_memory_mb: int = 4096
    #: pids cgroup limit of one container's jobs (the runner counts as one; the idle spares,
    #: and with preloads the zygote and its spares, come on top).
    pids_max: int = 64
    #: Job processes each container forks ahead, back to back (see runner.SPARES).
    spares: int = 4
    #: Sizes of the tmpfs at /job (the job's files) and /tmp of every pool container, in MiB.
    #: What the job writes there counts against its own memory limit (its step cgroup is
    #: charged for those pages); the job's input files, written by the runner, count in the
    #: container's limit, which has room for both mounts full.
    job_dir_mb: int = 128
    tmp_dir_mb: int = 64
    #: Writable-layer limit of a pool container: what a job writes outside /job and /tmp
    #: (/var/tmp, ...) lands on a size-limited filesystem, never on the node's disk unbounded.
    disk_mb: int = 256

    @property
    def tmpfs_bytes(self) -> int:
        return (self.job_dir_mb + self.tmp_dir_mb) * 1024 * 1024

    #: How long a job waits for a free container before the edge refuses it (EDGE_CAPACITY).
    queue_timeout_s: float = 30.0
    #: Jobs waiting per pool beyond which the edge refuses at once.
    max_queue: int = 10_000
    #: The unprivileged uid/gid jobs run as (RLIMIT_NPROC does not apply to uid 0).
    job_uid: int = 10001
    #: Containers started concurrently when filling pools.
    start_concurrency: int = 4


def parse_pools(raw: dict[str, str]) -> dict[str, int]:
    """{"python": "4", ...} (DSEC_EDGE_FNCALL_POOLS="python=4,cpp=2,bash=2") -> sizes."""
    out: dict[str, int] = {}
    for name, size in raw.items():
        if not ENV_NAME.match(name):
            raise ValueError(f"fncall environment name {name!r} must match {ENV_NAME.pattern}")
        try:
            n = int(size)
        except ValueError:
            raise ValueError(f"fncall pool size {name}={size!r} is not an integer") from None
        if not 0 <= n <= 256:
            raise ValueError(f"fncall pool size {name}={n} must be in 0..256")
        if n:
            out[name] = n
    return out


def environments(images: dict[str, str]) -> dict[str, Environment]:
    """The built-in environments, with images overridden or new environments added by
    DSEC_EDGE_FNCALL_IMAGES="name=image,..." (a new environment preloads nothing)."""
    out = dict(BUILTIN)
    for name, image in images.items():
        if not ENV_NAME.match(name):
            raise ValueError(f"fncall environment name {name!r} must match {ENV_NAME.pattern}")
        base = out.get(name)
        out[name] = (
            Environment(name, image, base.preload, base.interpreter, base.gpu)
            if base
            else Environment(name, image)
        )
    return out
