"""Which accelerator boots guests on this host: KVM where it works, else TCG, else none.

`/dev/kvm` existing is not enough: on this machine kind KVM runs only PVM guests and a normal
guest hangs. So the edge boots the guest kernel with the real initramfs in probe mode
(`dsec.probe` on the command line: init prints DSEC-PROBE-OK and powers off) under each
candidate, with a deadline, and offers microVMs on the first that works. The verdict is kept
per host boot, QEMU binary and guest kit in the node-wide cache, so later edge starts cost
nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from edge.backends.guests import tsc_khz
from edge.backends.microvm.guest import GuestKit

PROBE_TIMEOUT_S = {"kvm": 8.0, "tcg": 30.0}


@dataclass(frozen=True)
class Verdict:
    accel: str  # "kvm" | "tcg" | "" (neither boots)
    why: str  # what was tried and what happened
    boot_s: float = 0.0


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def probe(kit: GuestKit, cache_dir: Path, wanted: str, qemu: str = "qemu-system-x86_64") -> Verdict:
    """The accelerator to use (`wanted`: auto, kvm or tcg). Blocking: seconds on a first run."""
    key = {
        "boot": _boot_id(),
        "qemu": qemu,
        "version": _qemu_id(qemu),
        "kit": kit.digest,
        "wanted": wanted,
    }
    cached = cache_dir / "accel.json"
    try:
        saved = json.loads(cached.read_text())
        if saved.get("key") == key:
            return Verdict(saved["accel"], saved["why"], saved.get("boot_s", 0.0))
    except (OSError, ValueError, KeyError):
        pass
    candidates = ["kvm", "tcg"] if wanted == "auto" else [wanted]
    notes = []
    verdict = Verdict("", "")
    for accel in candidates:
        if accel == "kvm" and not os.access("/dev/kvm", os.R_OK | os.W_OK):
            notes.append("kvm: /dev/kvm is not there")
            continue
        ok, note, took = _boot(kit, accel, qemu)
        notes.append(f"{accel}: {note}")
        if ok:
            verdict = Verdict(accel, "; ".join(notes), took)
            break
    else:
        verdict = Verdict("", "; ".join(notes))
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")  # two edges may probe at once
    tmp.write_text(json.dumps({"key": key, **verdict.__dict__}))
    os.replace(tmp, cached)
    return verdict


def _qemu_id(qemu: str) -> str:
    try:
        out = subprocess.run([qemu, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unavailable: {exc}"
    return out.stdout.splitlines()[0] if out.stdout else out.stderr.strip()


def _boot(kit: GuestKit, accel: str, qemu: str) -> tuple[bool, str, float]:
    """Boot the probe guest; (booted, what happened, seconds)."""
    timeout = PROBE_TIMEOUT_S[accel]
    with tempfile.TemporaryDirectory(prefix="dsec-probe-") as d:
        serial = Path(d) / "serial"
        argv = [
            qemu, "-M", "microvm,acpi=on", "-accel", accel,
            "-cpu", "host" if accel == "kvm" else "max", "-m", "128M", "-smp", "1",
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(kit.kernel), "-initrd", str(kit.initrd),
            "-append", f"console=ttyS0 tsc_early_khz={tsc_khz()} quiet panic=-1 dsec.probe",
            "-serial", f"file:{serial}",
        ]  # fmt: skip
        t0 = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)  # fmt: skip
        except OSError as exc:
            return False, f"cannot run {qemu}: {exc}", 0.0
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return False, f"no boot within {timeout:.0f} s (the guest hangs)", timeout
        took = time.monotonic() - t0
        text = serial.read_text(errors="replace") if serial.exists() else ""
        if "DSEC-PROBE-OK" in text:
            return True, f"a guest booted in {took:.1f} s", took
        why = err.decode(errors="replace").strip() or text.strip()[-300:] or "no output"
        return False, f"QEMU exited {proc.returncode}: {why}", took
