"""The SWE-ReX front end's checks that need no cluster: its listener's config and where a
zipped directory's entries may land (tests/integration/test_swerex.py drives the API)."""

from __future__ import annotations

import pytest

from common.config import ConfigError
from compat.config import CompatConfig
from compat.swe_rex.app import _inside


def test_listener_config() -> None:
    CompatConfig(swerex_listen="127.0.0.1:7132").validate()
    CompatConfig(swerex_listen="").validate()  # not served
    with pytest.raises(ConfigError, match="host:port"):
        CompatConfig(swerex_listen="7132").validate()
    with pytest.raises(ConfigError, match="bad port"):
        CompatConfig(swerex_listen="127.0.0.1:x").validate()
    with pytest.raises(ConfigError, match="differ"):
        CompatConfig(listen="127.0.0.1:7130", swerex_listen="127.0.0.1:7130").validate()
    with pytest.raises(ConfigError, match="differ"):
        CompatConfig(swerex_listen="127.0.0.1:7131").validate()  # SandboxFusion's default


def test_zip_entries_stay_under_the_target() -> None:
    assert _inside("/work/tree", "sub/x.txt") == "/work/tree/sub/x.txt"
    assert _inside("/work/tree/", "./a") == "/work/tree/a"
    assert _inside("/", "etc/x") == "/etc/x"
    for bad in ("../x", "sub/../../x", "/etc/passwd"):
        with pytest.raises(ValueError, match="leaves /work/tree"):
            _inside("/work/tree", bad)
