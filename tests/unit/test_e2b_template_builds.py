"""The pieces of E2B template builds that need no cluster (compat/e2b/templates.py): E2B's
name and tag rules, COPY's glob base, the signed upload URLs and the bounded file cache, and
the build status's log paging."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from compat.e2b.http import HttpError
from compat.e2b.templates import Build, FileCache, _glob_base, check_tag, parse_name

HASH_A = "a" * 64
HASH_B = "b" * 64


def test_names_and_tags_follow_e2bs_rules() -> None:
    assert parse_name("My-Tpl") == ("my-tpl", None)
    assert parse_name("tpl:V1.2") == ("tpl", "v1.2")
    for bad in ["", ":v1", "a b", "tpl/x"]:
        with pytest.raises(HttpError) as exc:
            parse_name(bad)
        assert exc.value.status == 400
    for bad in [":invalid-tag", "tpl:", "", "9b2c7a56-1111-4222-8333-444455556666"]:
        with pytest.raises(HttpError) as exc:
            check_tag(bad)
        assert exc.value.status == 400 and "invalid tag" in exc.value.message
    with pytest.raises(HttpError):
        parse_name("tpl:")  # a colon with no tag


def test_copy_sources_lose_their_glob_part() -> None:
    assert _glob_base("folder/*") == "folder"
    assert _glob_base("folder/**/*.py") == "folder"
    assert _glob_base("folder/file.txt") == "folder/file.txt"
    assert _glob_base("*.txt") == "."
    assert _glob_base("./dir/") == "dir"


def _stream(data: bytes, piece: int = 7) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for i in range(0, len(data), piece):
            yield data[i : i + piece]

    return gen()


def test_upload_urls_are_signed_per_project_and_hash_and_expire(tmp_path: Path) -> None:
    cache = FileCache(str(tmp_path), 1000, 100, "secret")
    token = cache.token("proj", HASH_A)
    assert cache.check(token) == ("proj", HASH_A)
    raw, _, sig = token.partition(".")
    for forged in [
        f"{raw}.{'0' * len(sig)}",
        raw,
        FileCache(str(tmp_path), 1, 1, "x").token("proj", HASH_A),
    ]:
        with pytest.raises(HttpError) as exc:
            cache.check(forged)
        assert exc.value.status == 403
    with pytest.raises(HttpError, match="expired"):
        cache.check(cache.token("proj", HASH_A, ttl_s=-1))


def test_the_cache_is_bounded_per_upload_and_per_project(tmp_path: Path) -> None:
    cache = FileCache(str(tmp_path), 100, 60, "")
    with pytest.raises(HttpError) as exc:
        asyncio.run(cache.store("p", HASH_A, _stream(b"x" * 61)))
    assert exc.value.status == 413
    assert not cache.present("p", HASH_A)
    assert list((tmp_path / "p").iterdir()) == []  # nothing half-written is left
    asyncio.run(cache.store("p", HASH_A, _stream(b"a" * 60)))
    old = time.time() - 100
    os.utime(cache.path("p", HASH_A), (old, old))
    asyncio.run(cache.store("p", HASH_B, _stream(b"b" * 60)))  # 120 > 100: the oldest goes
    assert cache.present("p", HASH_B) and not cache.present("p", HASH_A)
    assert not cache.present("other", HASH_B)  # per project
    assert cache.path("p", HASH_B).read_bytes() == b"b" * 60


def test_status_pages_logs_by_offset_and_filters_levels() -> None:
    b = Build("id", "proj", "tpl", ["default"], 1, 512)
    for i in range(5):
        b.log(f"line {i}", level="error" if i == 3 else "info")
    page = b.status_json(2, 2, "")
    assert [e["message"] for e in page["logEntries"]] == ["line 2", "line 3"]
    assert page["status"] == "waiting" and page["templateID"] == "tpl"
    assert [e["message"] for e in b.status_json(0, 100, "error")["logEntries"]] == ["line 3"]
    assert b.status_json(5, 100, "")["logEntries"] == []
