"""A full VM as libvirt sees it: its domain XML, and the XML inside a libvirt save file.

Every sandbox is one libvirt domain named `dsec-<edge tag>-<sandbox id>` (the tag tells this
edge's domains from any other's: orphan cleanup touches only its own). It is a q35 machine:

    vda   the sandbox's disk: a qcow2 overlay (virtual size = its disk limit) whose backing
          file is the image's disk.qcow2 (a cold boot) or a template's frozen disk
    vdb   the toolkit (aether, chronus and their Python; EROFS, read-only, serial "tk")
    net   virtio-net on a persistent tap of the edge's (`target dev`, managed="no"): the
          host-side network path (edge/network/guest.py, root_tap)
    dsec.aether   a virtio-serial port; QEMU listens on `<sockets>/<id>.agent`, the edge
          connects (the same framed wire as a container's aether socket)
    ttyS0 the serial console; QEMU listens on `<sockets>/<id>.console`, the edge reads it
          (edge/backends/guest_console.py: panics, OOM kills)
    pvpanic  a guest kernel panic is a libvirt "crashed" event
    display  (images with one) VGA at a fixed mode, a USB tablet (absolute pointer) and
          keyboard for input events, VNC on `<sockets>/<id>.vnc` (never a TCP port)

The kernel and initramfs are the image's own, booted directly (`<kernel>`, `<initrd>`).

A template's clones are restored from one libvirt save file, whose header carries the
domain XML it restores. libvirt's restore refuses an XML whose UUID differs from the saved
one (and two domains cannot share a UUID), so the edge rewrites that XML in place for each
clone (`write_saved_xml`, under the template's lock) with the clone's name, UUID and host-side
paths; the devices, and so the guest's view of its machine, stay the template's.
"""

from __future__ import annotations

import struct
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

#: libvirt's save image header (src/qemu/qemu_saveimage.h): magic, version, data_len,
#: was_running, compressed, cookieOffset, 14 unused words; then data_len bytes of XML, NUL,
#: cookie XML, NUL, zero padding (libvirt leaves room to rewrite the XML in place).
SAVE_MAGIC = (b"LibvirtQemudSave", b"LibvirtQemudPart")
_HEADER = struct.Struct("<16s5I56x")
METADATA_NS = "https://dsec.dev/xmlns/vm/1"
#: The display's fixed mode (the e2b-desktop SDK's default resolution).
SCREEN = (1024, 768)


@dataclass(frozen=True)
class DomainPaths:
    disk: Path
    toolkit: Path
    agent: Path
    console: Path
    vnc: Path | None


@dataclass(frozen=True)
class DomainSpec:
    name: str
    sandbox_id: str
    vcpus: int
    memory_mb: int
    kernel: Path
    initrd: Path
    cmdline: str
    paths: DomainPaths
    tap: str
    mac: str
    accel: str  # "kvm" | "tcg"
    display: bool
    cpu_quota_us: int  # for the whole guest per 100 ms period
    memory_limit_mb: int  # guest RAM + QEMU's overhead


def domain_name(tag: str, sandbox_id: str) -> str:
    return f"dsec-{tag}-{sandbox_id}"


def sandbox_of(name: str, tag: str) -> str | None:
    """The sandbox id in a domain name of this edge's, or None."""
    prefix = f"dsec-{tag}-"
    return name[len(prefix) :] if name.startswith(prefix) else None


def domain_xml(spec: DomainSpec) -> str:
    p = spec.paths
    display = ""
    if spec.display:
        display = f"""
    <graphics type='vnc' socket={quoteattr(str(p.vnc))}/>
    <video><model type='vga' vram='16384' heads='1' primary='yes'/></video>
    <input type='tablet' bus='usb'/>
    <input type='keyboard' bus='usb'/>"""
    else:
        display = "\n    <video><model type='none'/></video>"
    return f"""<domain type='{"kvm" if spec.accel == "kvm" else "qemu"}'>
  <name>{escape(spec.name)}</name>
  <uuid>{uuid.uuid4()}</uuid>
  <metadata><dsec:sandbox xmlns:dsec='{METADATA_NS}' id={quoteattr(spec.sandbox_id)}/></metadata>
  <memory unit='MiB'>{spec.memory_mb}</memory>
  <vcpu>{spec.vcpus}</vcpu>
  <cputune><global_period>100000</global_period><global_quota>{spec.cpu_quota_us}</global_quota></cputune>
  <cpu mode='{"host-passthrough" if spec.accel == "kvm" else "maximum"}'/>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>{escape(str(spec.kernel))}</kernel>
    <initrd>{escape(str(spec.initrd))}</initrd>
    <cmdline>{escape(spec.cmdline)}</cmdline>
  </os>
  <features><acpi/><apic/></features>
  <clock offset='utc'/>
  <on_poweroff>destroy</on_poweroff>
  <on_reboot>destroy</on_reboot>
  <on_crash>destroy</on_crash>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2' discard='unmap'/>
      <source file={quoteattr(str(p.disk))}/>
      <target dev='vda' bus='virtio'/>
      <serial>rw</serial>
    </disk>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file={quoteattr(str(p.toolkit))}/>
      <target dev='vdb' bus='virtio'/>
      <readonly/>
      <serial>tk</serial>
    </disk>
    <interface type='ethernet'>
      <mac address='{spec.mac}'/>
      <target dev={quoteattr(spec.tap)} managed='no'/>
      <model type='virtio'/>
    </interface>
    <channel type='unix'>
      <source mode='bind' path={quoteattr(str(p.agent))}/>
      <target type='virtio' name='dsec.aether'/>
    </channel>
    <serial type='unix'>
      <source mode='bind' path={quoteattr(str(p.console))}/>
      <target port='0'/>
    </serial>{display}
    <panic model='isa'/>
    <memballoon model='none'/>
    <rng model='virtio'><backend model='random'>/dev/urandom</backend></rng>
  </devices>
</domain>"""


def clone_xml(saved: str, spec: DomainSpec) -> str:
    """A template's saved XML made a clone's: its name, a new UUID, its metadata, host-side
    paths, tap and limits. Devices, addresses and the machine stay the template's."""
    root = ET.fromstring(saved)
    _set_text(root, "name", spec.name)
    _set_text(root, "uuid", str(uuid.uuid4()))
    meta = root.find("metadata")
    if meta is not None:
        for child in list(meta):
            meta.remove(child)
        ET.SubElement(meta, f"{{{METADATA_NS}}}sandbox", id=spec.sandbox_id)
    p = spec.paths
    for disk in root.findall("devices/disk"):
        serial = disk.findtext("serial")
        source = disk.find("source")
        if source is None:
            continue
        if serial == "rw":
            source.set("file", str(p.disk))
            backing = disk.find("backingStore")
            if backing is not None:
                disk.remove(backing)  # libvirt reads the chain from the new overlay
        elif serial == "tk":
            source.set("file", str(p.toolkit))
    for iface in root.findall("devices/interface"):
        target = iface.find("target")
        if target is not None:
            target.set("dev", spec.tap)
    for chan in root.findall("devices/channel"):
        _set_source(chan, "path", str(p.agent))
    for tag in ("serial", "console"):
        for dev in root.findall(f"devices/{tag}"):
            _set_source(dev, "path", str(p.console))
    for g in root.findall("devices/graphics"):
        if p.vnc is not None:
            g.set("socket", str(p.vnc))
            for listen in g.findall("listen"):
                if listen.get("type") == "socket":
                    listen.set("socket", str(p.vnc))
    quota = root.find("cputune/global_quota")
    if quota is not None:
        quota.text = str(spec.cpu_quota_us)
    return ET.tostring(root, encoding="unicode")


def _set_text(root: ET.Element, tag: str, text: str) -> None:
    el = root.find(tag)
    if el is None:
        raise ValueError(f"saved domain XML has no <{tag}>")
    el.text = text


def _set_source(dev: ET.Element, attr: str, value: str) -> None:
    source = dev.find("source")
    if source is not None:
        source.set(attr, value)


# ----------------------------------------------------------------- save files


def read_saved_xml(path: Path) -> tuple[str, str]:
    """(domain XML, cookie XML) of a libvirt save file."""
    with open(path, "rb") as f:
        magic, _version, data_len, _running, compressed, cookie_at = _HEADER.unpack(
            f.read(_HEADER.size)
        )
        if magic not in SAVE_MAGIC:
            raise ValueError(f"{path} is not a libvirt save file")
        if compressed:
            raise ValueError(f"{path} is compressed: the edge writes its saves uncompressed")
        data = f.read(data_len)
    xml_end = data.index(b"\0")
    cookie = ""
    if cookie_at:
        cookie = data[cookie_at : data.index(b"\0", cookie_at)].decode()
    return data[:xml_end].decode(), cookie


def write_saved_xml(path: Path, xml: str, cookie: str) -> None:
    """Replace the domain XML of a libvirt save file in place (the memory after it stays)."""
    with open(path, "r+b") as f:
        magic, version, data_len, running, compressed, _ = _HEADER.unpack(f.read(_HEADER.size))
        if magic not in SAVE_MAGIC:
            raise ValueError(f"{path} is not a libvirt save file")
        x = xml.encode() + b"\0"
        c = cookie.encode() + b"\0" if cookie else b""
        if len(x) + len(c) > data_len:
            raise ValueError(
                f"the new domain XML ({len(x)} bytes) does not fit the save file's room "
                f"({data_len} bytes)"
            )
        f.seek(0)
        f.write(_HEADER.pack(magic, version, data_len, running, compressed, len(x) if c else 0))
        f.write((x + c).ljust(data_len, b"\0"))
