"""Pure parts of snapshots and pauses: the project-private environment namespace
(apiserver/snapshots.py), E2B snapshot ids and pages (compat/e2b/snapshots.py), and E2B's
autoPause options as dsec's spec fields (compat/e2b/mapping.py)."""

from __future__ import annotations

import pytest

from apiserver import snapshots as ns
from compat.e2b import mapping
from compat.e2b import snapshots as snaps
from compat.e2b.http import HttpError
from libdsec import Environment
from libdsec.errors import ImageNotFound, PermissionDenied


def test_namespace_owner_and_visibility() -> None:
    assert ns.owner_of("snapshots/root/snap-1:default") == "root"
    assert ns.owner_of("snapshots/team/sub/x:v1") == "team/sub"
    assert ns.owner_of("snapshots/team/x") == "team"
    assert ns.owner_of("bookworm:latest") is None
    assert ns.visible("other", "bookworm") and ns.visible("team", "snapshots/team/x:default")
    assert not ns.visible("other", "snapshots/team/x:default")
    with pytest.raises(ImageNotFound):
        ns.check_visible("other", "snapshots/team/x:default")
    with pytest.raises(PermissionDenied):
        ns.check_packable("other", "snapshots/team/x:default")
    ns.check_packable("team", "snapshots/team/x:default")
    ns.check_packable("anyone", "my-env:1")


def test_snapshot_refs() -> None:
    assert snaps.parse_ref("snap-1") == snaps.SnapshotRef("snap-1", "default")
    assert snaps.parse_ref("team-slug/my-snap:v2") == snaps.SnapshotRef("my-snap", "v2")
    assert snaps.parse_ref("Bad Name", strict=False) is None
    with pytest.raises(HttpError) as err:
        snaps.parse_ref("Bad Name")
    assert err.value.status == 400
    ref = snaps.new_ref("mine")
    assert ref.snapshot_id == "mine:default"
    assert ref.environment("p/q") == "snapshots/p/q/mine:default"
    assert snaps.new_ref(None).name.startswith("snap-")
    with pytest.raises(HttpError):
        snaps.new_ref(3)


def _env(name: str, sandbox: str) -> Environment:
    return Environment(name=f"snapshots/p/{name}", layers=[], config={"sandbox": sandbox})


def test_snapshot_page_filters_and_tokens() -> None:
    envs = [_env("a:default", "sb-1"), _env("b:default", "sb-1"), _env("c:v1", "sb-2")]
    items, token = snaps.page(envs, sandbox_id="sb-1", name="", limit="1", next_token=None)
    assert [e.name for e in items] == ["snapshots/p/a:default"] and token
    items, token = snaps.page(envs, sandbox_id="sb-1", name="", limit="1", next_token=token)
    assert [e.name for e in items] == ["snapshots/p/b:default"] and token == ""
    items, _ = snaps.page(envs, sandbox_id="", name="c", limit=None, next_token=None)
    assert [e.name for e in items] == ["snapshots/p/c:v1"]
    items, _ = snaps.page(envs, sandbox_id="", name="c:default", limit=None, next_token=None)
    assert items == []
    for bad in ({"limit": "0"}, {"limit": "x"}, {"next_token": "!!"}):
        with pytest.raises(HttpError):
            snaps.page(envs, sandbox_id="", name="", **{"limit": None, "next_token": None, **bad})


def test_auto_pause_options() -> None:
    assert mapping.auto_pause_of({}) == mapping.AutoPause(False, False, False)
    assert mapping.auto_pause_of({"autoPause": True}) == mapping.AutoPause(True, False, False)
    cold = mapping.auto_pause_of({"autoPause": True, "autoPauseMemory": False})
    assert cold == mapping.AutoPause(True, True, True)  # a connect resumes it, nothing else
    manual = mapping.auto_pause_of({"autoPause": True, "autoResume": {"enabled": False}})
    assert manual == mapping.AutoPause(True, False, True)
    for body in (
        {"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}},
        {"autoPauseMemory": "no"},
        {"autoResume": {"enabled": 1}},
        {"autoPause": "yes"},
    ):
        with pytest.raises(HttpError):
            mapping.auto_pause_of(body)
