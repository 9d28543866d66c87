"""Which accelerator runs full VMs here: KVM when a boot probe succeeds, TCG otherwise.

`/dev/kvm` existing is not enough (on this machine kind KVM runs only PVM guests and a normal
guest hangs). So the edge boots the image's own kernel through libvirt with no root disk and
no initramfs: a kernel that boots gets as far as "VFS: Unable to mount root fs" and panics
within seconds (printed on its serial console, which libvirt writes to a file); one that
hangs does not. The verdict is kept per host boot, libvirt and kernel in the node-wide cache
(`vm-accel.json`), so later edge starts cost nothing; `dsec status` shows it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path

import libvirt

from edge.backends.guests import tsc_khz
from edge.backends.vm.images import VmImage
from edge.backends.vm.libvirt_conn import Libvirt

PROBE_TIMEOUT_S = {"kvm": 10.0, "tcg": 40.0}
BOOTED = "Unable to mount root fs"


def probe(conn: Libvirt, image: VmImage, cache_dir: Path, wanted: str) -> tuple[str, str]:
    """(accelerator, what was tried) -- ("", why) when neither boots. Blocking."""
    key = {
        "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "libvirt": libvirt.getVersion(),
        "kernel": f"{image.kernel}:{image.kernel.stat().st_size}",
        "wanted": wanted,
    }
    cached = cache_dir / "vm-accel.json"
    try:
        saved = json.loads(cached.read_text())
        if saved.get("key") == key:
            return str(saved["accel"]), str(saved["why"])
    except (OSError, ValueError, KeyError):
        pass
    notes = []
    accel = ""
    for candidate in ["kvm", "tcg"] if wanted == "auto" else [wanted]:
        if candidate == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
            notes.append("kvm: /dev/kvm is not there")
            continue
        ok, note = _boot(conn, image, candidate)
        notes.append(f"{candidate}: {note}")
        if ok:
            accel = candidate
            break
    why = "; ".join(notes)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "accel": accel, "why": why}))
    os.replace(tmp, cached)
    return accel, why


def _boot(conn: Libvirt, image: VmImage, accel: str) -> tuple[bool, str]:
    timeout = PROBE_TIMEOUT_S[accel]
    name = f"dsec-probe-{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory(prefix="dsec-vm-probe-") as d:
        serial = Path(d) / "serial"
        xml = f"""<domain type='{"kvm" if accel == "kvm" else "qemu"}'>
  <name>{name}</name><memory unit='MiB'>256</memory><vcpu>1</vcpu>
  <cpu mode='{"host-passthrough" if accel == "kvm" else "maximum"}'/>
  <os><type arch='x86_64' machine='q35'>hvm</type><kernel>{image.kernel}</kernel>
    <cmdline>console=ttyS0 panic=-1 tsc_early_khz={tsc_khz()}</cmdline></os>
  <features><acpi/><apic/></features>
  <on_poweroff>destroy</on_poweroff><on_reboot>destroy</on_reboot><on_crash>destroy</on_crash>
  <devices><serial type='file'><source path='{serial}'/><target port='0'/></serial>
    <memballoon model='none'/></devices>
</domain>"""
        c = conn.open()
        t0 = time.monotonic()
        try:
            dom = c.createXML(xml, 0)
        except libvirt.libvirtError as exc:
            return False, f"libvirt refused the domain: {exc.get_error_message()}"
        try:
            while time.monotonic() - t0 < timeout:
                text = serial.read_text(errors="replace") if serial.exists() else ""
                if BOOTED in text:
                    return True, f"a guest kernel booted in {time.monotonic() - t0:.1f} s"
                time.sleep(0.2)
            return False, f"no boot within {timeout:.0f} s (the guest hangs)"
        finally:
            try:
                if dom.isActive():
                    dom.destroy()
            except libvirt.libvirtError:
                pass
