"""The edge's usage samples (edge/usage.py): the ring keeps the last N, CPU use is a share of
the sandbox's limit between consecutive samples, cgroup v1 memory is read as `docker stats`
reads it, and the edge's settings are checked."""

from __future__ import annotations

import pytest

from common.config import ConfigError, load
from edge.config import EdgeConfig
from edge.usage import UsageRing, memory_v1


def test_the_ring_keeps_the_last_samples_and_turns_cpu_time_into_a_share_of_the_limit() -> None:
    ring = UsageRing(capacity=3)
    assert ring.last() is None and ring.between(0, 1e12, 2.0) == []
    # 2 cores: 1 CPU-second over 1 s is 50%; 4 over 2 s is 100%; none over 1 s is 0.
    for at, cpu in ((100.0, 10.0), (101.0, 11.0), (103.0, 15.0), (104.0, 15.0)):
        ring.add(at, cpu, 1 << 20, 2 << 20, 3 << 20, 4 << 20)
    assert len(ring) == 3 and ring.last_at == 104.0
    got = ring.between(0, 1e12, 2.0)
    # The oldest kept (101) has no sample before it in the ring: 0, not a made-up share.
    assert [(s.at, s.cpu_used_pct) for s in got] == [(101.0, 0.0), (103.0, 100.0), (104.0, 0.0)]
    assert (got[0].mem_used_bytes, got[0].disk_total_bytes) == (1 << 20, 4 << 20)
    # A window keeps the share computed against the sample before it, even outside it.
    assert [(s.at, s.cpu_used_pct) for s in ring.between(102, 103.5, 2.0)] == [(103.0, 100.0)]
    # More than the limit (a burst measured over a short interval) is shown as 100.
    ring.add(104.5, 17.0, 0, 0, 0, 0)
    assert ring.between(104.2, 105, 2.0)[0].cpu_used_pct == 100.0


def test_cgroup_v1_memory_is_usage_less_inactive_file_cache() -> None:
    stat = b"cache 5\nrss 7\ntotal_cache 4096\ntotal_rss 8192\ntotal_inactive_file 1024\n"
    assert memory_v1(b"20480\n", stat) == (20480 - 1024, 4096)
    assert memory_v1(b"", stat) == (0, 0)  # the sandbox just ended: nothing read
    assert memory_v1(b"100\n", b"total_inactive_file 500\n") == (0, 0)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"DSEC_EDGE_USAGE_SAMPLE_S": "0.5"}, "USAGE_SAMPLE_S"),  # below the watchdog's pass
        ({"DSEC_EDGE_USAGE_SAMPLE_S": "5000"}, "USAGE_SAMPLE_S"),
        ({"DSEC_EDGE_USAGE_KEEP_S": "2"}, "USAGE_KEEP_S"),  # less than one interval
        ({"DSEC_EDGE_USAGE_KEEP_S": "1e9"}, "USAGE_KEEP_S"),
    ],
)
def test_bad_usage_settings_are_refused_at_start(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load(EdgeConfig, "EDGE", env)
