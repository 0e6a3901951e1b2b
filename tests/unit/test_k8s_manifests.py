"""The Kubernetes manifests in deploy/k8s/ (docs/deployment.md, "Kubernetes"): each document
validates against the Kubernetes OpenAPI schemas bundled by ``kubernetes-validate`` (strict: unknown
fields fail), and the Deployment agrees with the server: its args parse with the real
``duplexkit serve`` parser, its probes name routes the app serves, and its termination grace covers
the drain time."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed "
                         "(scripts/setup.sh installs it with the dev extra: pip install kubernetes-validate)")

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
#: the oldest Kubernetes minor still supported upstream when written, and the newest schema bundled
VERSIONS = ("1.30", kv.latest_version() if hasattr(kv, "latest_version") else "1.30")


def _docs() -> list[tuple[str, dict]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        for d in yaml.safe_load_all(f.read_text()):
            if d is not None:
                out.append((f.name, d))
    return out


def _deployment() -> dict:
    deps = [d for _, d in _docs() if d["kind"] == "Deployment"]
    assert len(deps) == 1
    return deps[0]


def test_manifests_exist():
    kinds = sorted(d["kind"] for _, d in _docs())
    assert kinds == ["Deployment", "PodDisruptionBudget", "Service"]


@pytest.mark.parametrize("version", sorted(set(VERSIONS)))
def test_manifests_validate_against_the_kubernetes_schema(version):
    for name, doc in _docs():
        kv.validate(doc, version, strict=True)  # raises kubernetes_validate.ValidationError


def test_the_validator_rejects_a_broken_manifest():
    bad = copy.deepcopy(_deployment())
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/ready"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, VERSIONS[0], strict=True)


def test_deployment_matches_the_server():
    from duplexkit.cli import build_parser
    from duplexkit.testing import ScriptedEngine
    from duplexkit_server import ServerSettings, create_app

    dep = _deployment()
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = build_parser().parse_args(c["args"])  # SystemExit on an unknown or malformed flag
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert c["ports"][0]["containerPort"] == args.port
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    # the pod is killed terminationGracePeriodSeconds after SIGTERM: the drain and the close must fit
    assert pod["terminationGracePeriodSeconds"] >= args.drain_s + ServerSettings().shutdown_grace_s + 5
    routes = {getattr(r, "path", None) for r in create_app(ScriptedEngine()).routes}
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready" and "/ready" in routes
    assert c["livenessProbe"]["httpGet"]["path"] == "/live" and "/live" in routes
    svc = [d for _, d in _docs() if d["kind"] == "Service"][0]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]
