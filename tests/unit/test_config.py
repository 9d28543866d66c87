from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from apiserver.config import ApiServerConfig
from common.config import ConfigError, ServiceConfig, env_names, load
from edge.config import EdgeConfig
from iam.config import IamConfig
from placement.config import PlacementConfig
from watcher.config import WatcherConfig


@dataclass(frozen=True)
class Sample(ServiceConfig):
    count: int = 1
    ratio: float = 0.5
    enabled: bool = False
    path: Path = Path("/tmp")
    names: tuple[str, ...] = ()
    labels: dict[str, str] | None = None
    optional: Path | None = None


def test_defaults_without_environment() -> None:
    cfg = load(Sample, "SAMPLE", {})
    assert cfg == Sample()


def test_values_are_converted_by_annotation() -> None:
    cfg = load(
        Sample,
        "SAMPLE",
        {
            "DSEC_SAMPLE_COUNT": "7",
            "DSEC_SAMPLE_RATIO": "1.25",
            "DSEC_SAMPLE_ENABLED": "yes",
            "DSEC_SAMPLE_PATH": "/var/x",
            "DSEC_SAMPLE_NAMES": "a, b,,c",
            "DSEC_SAMPLE_LABELS": "zone=a,location=cloud",
            "DSEC_SAMPLE_OPTIONAL": "/o",
            "DSEC_SAMPLE_LISTEN": "unix:/tmp/s.sock",
        },
    )
    assert (cfg.count, cfg.ratio, cfg.enabled, cfg.path) == (7, 1.25, True, Path("/var/x"))
    assert cfg.names == ("a", "b", "c")
    assert cfg.labels == {"zone": "a", "location": "cloud"}
    assert cfg.optional == Path("/o") and cfg.listen == "unix:/tmp/s.sock"


@pytest.mark.parametrize(
    ("var", "value", "needle"),
    [
        ("DSEC_SAMPLE_COUNT", "seven", "expected an integer"),
        ("DSEC_SAMPLE_RATIO", "x", "expected a number"),
        ("DSEC_SAMPLE_ENABLED", "maybe", "expected a boolean"),
        ("DSEC_SAMPLE_LABELS", "novalue", "key=value"),
        ("DSEC_SAMPLE_LOG_LEVEL", "LOUD", "log_level"),
    ],
)
def test_bad_values_name_the_variable(var: str, value: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(Sample, "SAMPLE", {var: value})
    assert needle in str(info.value)
    if needle != "log_level":
        assert var in str(info.value)


def test_every_service_config_loads_with_defaults_and_validates() -> None:
    for cls, svc in [
        (IamConfig, "IAM"),
        (ApiServerConfig, "APISERVER"),
        (PlacementConfig, "PLACEMENT"),
        (WatcherConfig, "WATCHER"),
        (EdgeConfig, "EDGE"),
    ]:
        cfg = load(cls, svc, {})
        assert cfg.listen.startswith("127.0.0.1:")
        assert f"DSEC_{svc}_LISTEN" in env_names(cls, svc)


def test_service_specific_validation() -> None:
    with pytest.raises(ConfigError, match="EDGE_ID"):
        load(EdgeConfig, "EDGE", {"DSEC_EDGE_EDGE_ID": "Bad_Id"})
    with pytest.raises(ConfigError, match="RUNTIME"):
        load(EdgeConfig, "EDGE", {"DSEC_EDGE_RUNTIME": "docker"})
    with pytest.raises(ConfigError, match="DSEC_EDGE_EROFS_MOUNT='fuse': expected auto, file or"):
        load(EdgeConfig, "EDGE", {"DSEC_EDGE_EROFS_MOUNT": "fuse"})
    with pytest.raises(ConfigError, match="BURST_THRESHOLD"):
        load(PlacementConfig, "PLACEMENT", {"DSEC_PLACEMENT_BURST_THRESHOLD": "1.5"})
    with pytest.raises(ConfigError, match="DATABASE"):
        load(IamConfig, "IAM", {"DSEC_IAM_DATABASE": "mysql://x"})
    edge = load(
        EdgeConfig, "EDGE", {"DSEC_EDGE_CPU_MILLIS": "2000", "DSEC_EDGE_CPU_OVERCOMMIT": "2"}
    )
    assert edge.effective_cpu_millis() == 4000


def test_microvm_memory_settings_that_cannot_work_refuse_the_start_saying_why() -> None:
    with pytest.raises(ConfigError, match="never given device memory"):
        load(EdgeConfig, "EDGE", {"DSEC_EDGE_MICROVM_PMEM": "true"})
    with pytest.raises(ConfigError, match="punching a hole"):
        load(EdgeConfig, "EDGE", {"DSEC_EDGE_MICROVM_FREE_PAGE_REPORTING": "true"})
    cold = {"DSEC_EDGE_MICROVM_FREE_PAGE_REPORTING": "true", "DSEC_EDGE_MICROVM_TEMPLATES": "0"}
    assert load(EdgeConfig, "EDGE", cold).microvm_free_page_reporting
    # Without microVMs neither matters.
    assert load(EdgeConfig, "EDGE", {"DSEC_EDGE_MICROVM": "off", "DSEC_EDGE_MICROVM_PMEM": "1"})
