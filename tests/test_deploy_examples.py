"""The deployment examples say what kvflow accepts: the Kubernetes Deployment's and the Dockerfile's arguments parse
with kvflow's own CLI into valid configs, and the probes name the health routes the server has (no cluster or
container runtime here: the examples themselves are untested, README says so)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from kvflow.cli import build_parser
from kvflow.server.cli import configs_from_args

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "examples" / "kubernetes"


def serve_configs(argv: list[str]):
    return configs_from_args(build_parser().parse_args(argv))


def test_kubernetes_deployment_args_and_probes():
    docs = {d["kind"]: d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if "kind" in d}
    assert {"Deployment", "Service", "ServiceMonitor"} <= set(docs)
    container = docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    engine, server = serve_configs(container["args"])
    assert server.port == container["ports"][0]["containerPort"] and server.request_log == "-"
    grace = docs["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > server.shutdown_grace_period       # the drain fits in the pod's grace period
    routes = set(re.findall(r'@router\.get\("([^"]+)"', (ROOT / "kvflow/server/observe/health.py").read_text()))
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert {"/health", "/health/live", "/metrics"} <= routes
    assert docs["ServiceMonitor"]["spec"]["endpoints"][0]["path"] == "/metrics"
    selector = docs["Service"]["spec"]["selector"]
    assert selector.items() <= docs["Deployment"]["spec"]["template"]["metadata"]["labels"].items()


def test_dockerfile_command():
    text = (ROOT / "Dockerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert entry == ["kvflow"]
    engine, server = serve_configs(cmd)
    assert (server.host, server.port) == ("0.0.0.0", 8000)
    assert "torch==2.13.0" in text       # the version pyproject pins
