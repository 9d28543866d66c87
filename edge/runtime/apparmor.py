"""An AppArmor profile for sandboxes, where the host has AppArmor.

This machine kind has no AppArmor (LSMs: landlock, bpf): there the edge says so once at start
and relies on Landlock (chronus), seccomp, namespaces and masked paths. On a host with AppArmor
the edge loads this profile once (`apparmor_parser -r`) and runc confines every sandbox process
with it (OCI process.apparmorProfile): Docker's docker-default rules, plus the toolkit and the
kernel's page and memory views denied. It adds a second, host-enforced layer beneath Landlock;
it is generated and loaded but cannot be exercised on this machine kind.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

PROFILE_NAME = "dsec-sandbox"
_SECURITYFS = Path("/sys/kernel/security/apparmor")


def available() -> bool:
    return _SECURITYFS.is_dir() and shutil.which("apparmor_parser") is not None


def profile_text(name: str = PROFILE_NAME) -> str:
    """The profile (after moby's docker-default template, plus dsec's denials)."""
    return f"""#include <tunables/global>

profile {name} flags=(attach_disconnected,mediate_deleted) {{
  #include <abstractions/base>

  network,
  capability,
  file,
  umount,
  # Sandboxes signal and trace only themselves; the runtime (unconfined) signals them.
  signal (receive) peer=unconfined,
  signal (send,receive) peer={name},
  ptrace (trace,read,tracedby,readby) peer={name},

  deny mount,
  deny @{{PROC}}/* w,
  deny @{{PROC}}/{{[^1-9],[^1-9][^0-9],[^1-9s][^0-9y][^0-9s],[^1-9][^0-9][^0-9][^0-9]*}}/** w,
  deny @{{PROC}}/sys/[^k]** w,
  deny @{{PROC}}/sys/kernel/{{?,??,[^s][^h][^m]**}} w,
  deny @{{PROC}}/sysrq-trigger rwklx,
  deny @{{PROC}}/kcore rwklx,
  deny @{{PROC}}/kpage* rwklx,
  deny @{{PROC}}/kmsg rwklx,
  deny /sys/kernel/mm/page_idle/** rwklx,
  deny /sys/[^f]*/** wklx,
  deny /sys/f[^s]*/** wklx,
  deny /sys/fs/[^c]*/** wklx,
  deny /sys/fs/c[^g]*/** wklx,
  deny /sys/fs/cg[^r]*/** wklx,
  deny /sys/firmware/** rwklx,
  deny /sys/kernel/security/** rwklx,
  # The toolkit (aether, chronus, their interpreter) is read-only for everyone.
  deny /.dsec/** wkl,
}}
"""


def load(name: str = PROFILE_NAME) -> bool:
    """Load (or replace) the profile; False, logged, if that fails."""
    r = subprocess.run(
        ["apparmor_parser", "-r", "-W"],
        input=profile_text(name),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if r.returncode != 0:
        log.error("loading AppArmor profile %s failed: %s", name, r.stderr.strip())
        return False
    log.info("AppArmor profile %s loaded: sandboxes run confined by it", name)
    return True
