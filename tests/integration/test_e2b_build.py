"""E2B template builds through the stock e2b SDK (``Template.build``) on dsec environments
(compat/e2b/templates.py): a build from E2B's base with COPY / RUN / ENV / WORKDIR / USER and
a start + ready command becomes the environment ``name:tag``; E2B's ``Sandbox.create(name)``
and dsec's ``create(image="name:default")`` both start from it with the template's files,
user, env, workdir and started process. Tags, exists, delete; a failing step (status error,
its output in the logs, no environment and no build sandbox left); an image from a registry
this machine cannot reach (a precise error naming it); another project (404, its name taken).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template, wait_for_file
from e2b.exceptions import BuildException, TemplateException

from libdsec import Client
from libdsec.errors import ImageNotFound
from tests.integration.conftest import ClusterWith
from tests.integration.e2b_support import E2bTarget, e2b_cluster, e2b_environment

pytestmark = pytest.mark.images("busybox", "bookworm", "e2b-base")


@pytest.fixture(scope="module")
def target(
    cluster_with: ClusterWith, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[E2bTarget]:
    files = tmp_path_factory.mktemp("e2b-template-files")
    env = {"DSEC_COMPAT_TEMPLATE_FILES_DIR": str(files)}
    with e2b_cluster(cluster_with, "e2bbuild", extra_env=env) as t, e2b_environment(t):
        yield t


@pytest.fixture(scope="module")
def container_cluster(target: E2bTarget):  # type: ignore[no-untyped-def]
    return target.cluster


@pytest.fixture(scope="module")
def other_key(target: E2bTarget) -> str:
    with Client(target.cluster.apiserver, token=target.cluster.token) as admin:
        other = admin.create_project("e2b-build-other")
        return admin.create_token(
            "e2b-build-other", project=other.project_id, agent=True, e2b=True
        ).secret


@pytest.fixture
def context(tmp_path: Path) -> Path:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "hello.txt").write_text("hello from the context\n")
    (tmp_path / "app" / "run.sh").write_text("#!/bin/sh\necho run\n")
    (tmp_path / "app" / "link.txt").symlink_to("hello.txt")
    (tmp_path / "single.cfg").write_text("key=value\n")
    return tmp_path


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def _delete(target: E2bTarget, name: str) -> None:
    with httpx.Client(base_url=target.url, timeout=60) as http:
        http.delete(f"/templates/{name}", headers={"X-API-Key": target.key})


def _no_build_sandboxes(target: E2bTarget) -> None:
    with Client(target.cluster.apiserver, token=target.key) as c:
        left = [s for s in c.list() if "e2b.template_build" in s.labels and not s.terminated]
    assert left == []


def test_a_built_template_starts_with_its_files_user_env_workdir_and_start_command(
    target: E2bTarget, context: Path
) -> None:
    name = _name("built")
    template = (
        Template(file_context_path=str(context))
        .from_base_image()
        .copy("app/*", "app")  # relative: under the user's home
        .copy("single.cfg", "/etc/demo/single.cfg", user="root", mode=0o600)
        .run_cmd("cat app/hello.txt && whoami && pwd")
        .run_cmd("touch /opt/made-by-root", user="root")
        .set_envs({"GREETING": "hi there", "MODE": "built"})
        .set_workdir("/srv/work")
        .run_cmd('echo "$GREETING" > note.txt')  # in the workdir, with the env
        .set_start_cmd("echo started > /tmp/started && sleep 3600", wait_for_file("/tmp/started"))
    )
    logs: list[str] = []
    try:
        info = Template.build(
            template,
            name,
            cpu_count=1,
            memory_mb=512,
            on_build_logs=lambda e: logs.append(e.message),
        )
        assert info.template_id == name and info.tags == ["default"]
        assert "hello from the context" in logs  # a RUN step's output is in the logs
        assert "user" in logs and "/home/user" in logs  # E2B's default user, in its home
        assert Template.exists(name)
        _no_build_sandboxes(target)

        sb = Sandbox.create(name)
        try:
            r = sb.commands.run(
                'whoami; pwd; echo "$GREETING/$MODE"; cat ~/app/hello.txt; readlink ~/app/link.txt;'
                " stat -c '%U %a' ~/app/hello.txt /etc/demo/single.cfg; ls /opt/made-by-root;"
                " cat note.txt; cat /tmp/started"
            )
            assert r.stdout.split("\n")[:-1] == [
                "user",
                "/srv/work",
                "hi there/built",
                "hello from the context",
                "hello.txt",
                "user 644",
                "root 600",
                "/opt/made-by-root",
                "hi there",
                "started",
            ]
            assert any("sleep 3600" in " ".join([p.cmd, *p.args]) for p in sb.commands.list())
        finally:
            sb.kill()

        # dsec's own create starts from the same environment (E2B's default tag)
        with Client(target.cluster.apiserver, token=target.key) as c:
            env = c.get_environment(f"{name}:default")
            assert env.config["e2b.user"] == "user" and env.config["workdir"] == "/srv/work"
            with c.create(image=f"{name}:default", ttl_s=120) as dsb:
                assert dsb.run("cat /srv/work/note.txt").text == "hi there\n"
    finally:
        _delete(target, name)


def test_tags_exists_and_delete(target: E2bTarget) -> None:
    name = _name("tagged")
    Template.build(Template().from_template("base"), f"{name}:v1", cpu_count=1, memory_mb=512)
    try:
        assigned = Template.assign_tags(f"{name}:v1", ["prod", "stable"])
        assert sorted(assigned.tags) == ["prod", "stable"]
        build_ids = {t.tag: t.build_id for t in Template.get_tags(name)}
        assert sorted(build_ids) == ["prod", "stable", "v1"]
        assert len(set(build_ids.values())) == 1 and assigned.build_id in build_ids.values()
        with pytest.raises(TemplateException, match="400"):
            Template.assign_tags(f"{name}:v1", ":bad")
        with pytest.raises(TemplateException, match="400"):
            Template.assign_tags(f"{name}:v1", f"{name}:")
        Template.remove_tags(name, "prod")
        assert sorted(t.tag for t in Template.get_tags(name)) == ["stable", "v1"]
        sb = Sandbox.create(f"{name}:stable")
        try:
            assert sb.commands.run("whoami").stdout == "user\n"
        finally:
            sb.kill()
        assert Template.exists(name) and not Template.exists(_name("missing"))
        assert Template.exists("base")
    finally:
        with httpx.Client(base_url=target.url, timeout=60) as http:
            r = http.delete(f"/templates/{name}", headers={"X-API-Key": target.key})
    assert r.status_code == 204, r.text
    assert not Template.exists(name)
    with Client(target.cluster.apiserver, token=target.key) as c:
        with pytest.raises(ImageNotFound):
            c.get_environment(f"{name}:v1")


def test_a_failing_step_fails_the_build_with_its_output_and_leaves_nothing(
    target: E2bTarget,
) -> None:
    name = _name("failing")
    template = (
        Template()
        .from_base_image()
        .run_cmd("echo fine")
        .run_cmd("echo boom-output-line; echo boom-on-stderr >&2; exit 3")
        .run_cmd("echo never")
    )
    logs: list[str] = []
    with pytest.raises(BuildException, match="exit status 3"):
        Template.build(template, name, on_build_logs=lambda e: logs.append(e.message))
    assert "boom-output-line" in logs and "boom-on-stderr" in logs and "never" not in logs
    # the status says which step and carries its output
    info = Template.build_in_background(template, name)
    status = Template.get_build_status(info)
    for _ in range(600):
        if status.status.value not in ("building", "waiting"):
            break
        time.sleep(0.2)
        status = Template.get_build_status(info)
    assert status.status.value == "error"
    assert status.reason is not None and status.reason.step == "2"
    assert "boom-output-line" in [e.message for e in status.reason.log_entries]
    assert not Template.exists(name)
    with Client(target.cluster.apiserver, token=target.key) as c:
        assert c.list_environments(f"{name}:") == []
    _no_build_sandboxes(target)


def test_an_image_from_an_unreachable_registry_fails_naming_it(target: E2bTarget) -> None:
    name = _name("registry")
    image = "registry.invalid/nobody/nothing:1"
    with pytest.raises(BuildException) as exc:
        Template.build(Template().from_image(image).run_cmd("true"), name)
    assert repr(image) in str(exc.value) and "pull" in str(exc.value)
    assert not Template.exists(name)


def test_what_dsec_cannot_build_is_refused_by_name(target: E2bTarget) -> None:
    """An instruction the SDK may send that dsec does not do, and registry credentials."""
    h = {"X-API-Key": target.key}
    with httpx.Client(base_url=target.url, timeout=60) as http:
        for body, says in [
            ({"steps": [{"type": "ARG", "args": ["X"], "force": False}]}, "'ARG'"),
            (
                {"fromImage": "x:1", "fromImageRegistry": {"type": "registry"}, "steps": []},
                "fromImageRegistry",
            ),
        ]:
            name = _name("refused")
            r = http.post(
                "/v3/templates", json={"name": name, "cpuCount": 1, "memoryMB": 512}, headers=h
            )
            assert r.status_code == 202, r.text
            build = r.json()["buildID"]
            r = http.post(f"/v2/templates/{name}/builds/{build}", json=body, headers=h)
            assert r.status_code == 202, r.text
            for _ in range(300):
                st = http.get(f"/templates/{name}/builds/{build}/status", headers=h).json()
                if st["status"] == "error":
                    break
                time.sleep(0.2)
            assert st["status"] == "error" and says in st["reason"]["message"], st
        # an upload URL is signed: another one is refused
        r = http.put("/_dsec/e2b/template-files/forged.sig", content=b"x")
        assert r.status_code == 403


def test_another_projects_template_is_404_and_its_name_taken(
    target: E2bTarget, other_key: str
) -> None:
    name = _name("mine")
    Template.build(Template().from_base_image(), name, cpu_count=1, memory_mb=512)
    try:
        assert not Template.exists(name, api_key=other_key)
        with pytest.raises(Exception, match="404"):
            Sandbox.create(name, api_key=other_key)
        with pytest.raises(Exception, match="404"):
            Sandbox.create(f"{name}:default", api_key=other_key)
        with pytest.raises(TemplateException, match="404"):
            Template.get_tags(name, api_key=other_key)
        with pytest.raises(BuildException, match="409"):
            Template.build(Template().from_base_image(), name, api_key=other_key)
        with httpx.Client(base_url=target.url, timeout=60) as http:
            r = http.delete(f"/templates/{name}", headers={"X-API-Key": other_key})
        assert r.status_code == 404
        assert Template.exists(name)
    finally:
        _delete(target, name)
