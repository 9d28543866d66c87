"""deploy/k8s/dsec.yaml is not exercised on a live Kubernetes cluster (none is available where
dsec is developed): this checks what can drift without one. Every DSEC_<SVC>_* variable it sets
is a setting of that service (a renamed setting would otherwise be silently ignored), every
workload runs the service it is named for, and every Service selects a workload and exposes a
port that workload's container declares."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from apiserver.config import ApiServerConfig
from compat.config import CompatConfig
from edge.config import EdgeConfig
from iam.config import IamConfig
from placement.config import PlacementConfig
from watcher.config import WatcherConfig

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "dsec.yaml"
CONFIGS: dict[str, type] = {
    "IAM": IamConfig,
    "WATCHER": WatcherConfig,
    "PLACEMENT": PlacementConfig,
    "APISERVER": ApiServerConfig,
    "COMPAT": CompatConfig,
    "EDGE": EdgeConfig,
}


def _docs() -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return list(doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []))


def _variables(c: dict[str, Any]) -> set[str]:
    names = {e["name"] for e in c.get("env", [])}
    for arg in c.get("args", []):
        names |= set(re.findall(r"export (DSEC_[A-Z_]+)=", arg))
    return {n for n in names if n.startswith("DSEC_")}


def test_every_dsec_variable_is_a_setting_of_its_service() -> None:
    seen = 0
    for doc in _docs():
        for c in _containers(doc):
            for var in _variables(c):
                svc = next((s for s in CONFIGS if var.startswith(f"DSEC_{s}_")), None)
                assert svc is not None, f"{doc['metadata']['name']}: {var} names no service"
                field = var.removeprefix(f"DSEC_{svc}_").lower()
                fields = {f.name for f in dataclasses.fields(CONFIGS[svc])}
                assert field in fields, f"{doc['metadata']['name']}: {var} is not a {svc} setting"
                seen += 1
    assert seen >= 20, seen


def test_each_workload_runs_its_service_and_each_service_selects_one() -> None:
    docs = _docs()
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "DaemonSet")}
    for name in ("iam", "watcher", "placement", "apiserver", "compat", "edge"):
        (c,) = _containers(workloads[name])
        argv = " ".join(c.get("command", []) + c.get("args", []))
        assert f"-m {name}" in argv, (name, argv)
    for svc in (d for d in docs if d["kind"] == "Service"):
        selector = svc["spec"]["selector"]
        targets = [
            d
            for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "DaemonSet")
            and d["spec"]["template"]["metadata"]["labels"] == selector
        ]
        assert targets, f"Service {svc['metadata']['name']} selects nothing"
        declared = {p["containerPort"] for c in _containers(targets[0]) for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["port"] in declared, (svc["metadata"]["name"], port)
