"""The full-VM backend's pieces that need no guest: a libvirt save file's XML rewritten in
place (how a template's clones get their own names), a clone's XML, the VM image catalogue's
errors, and libvirtd unreachable: refused at edge start with DSEC_EDGE_VM=on, a status line
saying why with auto, UNAVAILABLE for a call."""

from __future__ import annotations

import asyncio
import json
import struct
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from edge.backends.vm import domain
from edge.backends.vm.backend import VmBackend
from edge.backends.vm.images import VmImages
from edge.backends.vm.libvirt_conn import Libvirt
from edge.config import EdgeConfig
from edge.controls import ABSENT, ControlMissing
from libdsec.errors import InvalidArgument, Unavailable

UNREACHABLE = "qemu+unix:///system?socket=/nonexistent/libvirt-sock"


def spec(tmp: Path, sid: str) -> domain.DomainSpec:
    return domain.DomainSpec(
        name=domain.domain_name("tag0", sid),
        sandbox_id=sid,
        vcpus=1,
        memory_mb=768,
        kernel=tmp / "vmlinuz",
        initrd=tmp / "initrd.img",
        cmdline="root=/dev/vda",
        paths=domain.DomainPaths(
            disk=tmp / f"{sid}.qcow2",
            toolkit=tmp / "tk.erofs",
            agent=tmp / f"{sid}.agent",
            console=tmp / f"{sid}.console",
            vnc=tmp / f"{sid}.vnc",
        ),
        tap="dvabc",
        mac="02:00:00:00:00:01",
        accel="tcg",
        display=True,
        cpu_quota_us=100_000,
        memory_limit_mb=1024,
    )


def save_file(path: Path, xml: str, cookie: str, memory: bytes, room: int = 65536) -> None:
    """A file in libvirt's save format (src/qemu/qemu_saveimage.h), as libvirt writes it."""
    x = xml.encode() + b"\0"
    c = cookie.encode() + b"\0"
    header = struct.pack("<16s5I56x", b"LibvirtQemudSave", 2, room, 1, 0, len(x))
    path.write_bytes(header + (x + c).ljust(room, b"\0") + memory)


def test_a_save_files_xml_is_rewritten_in_place_and_its_memory_kept(tmp_path: Path) -> None:
    f = tmp_path / "state.save"
    template = domain.domain_xml(spec(tmp_path, "tmpl-1"))
    save_file(f, template, "<cookie/>", b"QEVM" + b"m" * 1000)
    size = f.stat().st_size
    xml, cookie = domain.read_saved_xml(f)
    assert (xml, cookie) == (template, "<cookie/>")
    clone = domain.clone_xml(xml, spec(tmp_path, "sb-2"))
    domain.write_saved_xml(f, clone, cookie)
    assert domain.read_saved_xml(f) == (clone, "<cookie/>")
    assert f.stat().st_size == size and f.read_bytes().endswith(b"QEVM" + b"m" * 1000)
    root = ET.fromstring(clone)
    assert root.findtext("name") == "dsec-tag0-sb-2"
    assert root.findtext("uuid") != ET.fromstring(template).findtext("uuid")
    sources = [d.find("source").get("file") for d in root.findall("devices/disk")]  # type: ignore[union-attr]
    assert sources == [str(tmp_path / "sb-2.qcow2"), str(tmp_path / "tk.erofs")]
    assert root.find("devices/graphics").get("socket") == str(tmp_path / "sb-2.vnc")  # type: ignore[union-attr]
    assert root.find("devices/channel/source").get("path") == str(tmp_path / "sb-2.agent")  # type: ignore[union-attr]


def test_an_xml_that_does_not_fit_the_save_files_room_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "state.save"
    save_file(f, "<domain/>", "", b"", room=64)
    with pytest.raises(ValueError, match="does not fit"):
        domain.write_saved_xml(f, "<domain>" + "x" * 100 + "</domain>", "")
    assert domain.read_saved_xml(f)[0] == "<domain/>"  # untouched


def test_a_file_that_is_not_a_libvirt_save_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_bytes(b"\0" * 200)
    with pytest.raises(ValueError, match="not a libvirt save file"):
        domain.read_saved_xml(f)


def test_an_unknown_vm_image_names_the_images_there_are(tmp_path: Path) -> None:
    for name in ("bookworm", "desktop"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "image.json").write_text(json.dumps({"root_mb": 1024}))
    with pytest.raises(InvalidArgument) as err:
        VmImages(tmp_path).get("python")
    assert err.value.reason == "IMAGE_NOT_FOUND"
    assert "bookworm, desktop" in err.value.message
    with pytest.raises(InvalidArgument) as err:
        VmImages(tmp_path).get("bookworm")  # no disk, kernel or initramfs
    assert err.value.reason == "IMAGE_NOT_BOOTABLE"


def test_libvirtd_unreachable_refuses_vms_at_edge_start(tmp_path: Path) -> None:
    cfg = EdgeConfig(state_dir=tmp_path, vm="auto", vm_uri=UNREACHABLE)
    built = VmBackend.from_config(cfg, node=None)  # type: ignore[arg-type]
    assert built.backend is None
    (control,) = built.controls
    assert control.state == ABSENT and "libvirtd is unreachable" in control.detail
    with pytest.raises(ControlMissing, match="DSEC_EDGE_VM=on requires them"):
        VmBackend.from_config(EdgeConfig(state_dir=tmp_path, vm="on", vm_uri=UNREACHABLE), None)  # type: ignore[arg-type]


def test_a_call_while_libvirtd_is_unreachable_is_unavailable() -> None:
    conn = Libvirt(UNREACHABLE)
    with pytest.raises(Unavailable) as err:
        asyncio.run(conn.call(lambda c: c.listAllDomains(0)))
    assert err.value.reason == "LIBVIRT_UNREACHABLE"
