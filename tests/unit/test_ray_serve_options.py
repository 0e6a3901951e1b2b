"""The Ray Serve deployment options duplexkit derives (docs/deployment.md, "Ray Serve") and the CLI's
answer when Ray is missing. Needs no Ray cluster."""

from __future__ import annotations

import sys

import pytest

from duplexkit.cli import EXIT_USAGE, main
from duplexkit_server import ServerSettings
from duplexkit.cli.ray_serve import gpus_of_layout
from duplexkit_server.ray_serve import DRAIN_MARGIN_S, RayOptions, deployment_options, drain_budget


def test_capacity_drain_and_autoscaling_options():
    s = ServerSettings(max_sessions=8, drain_s=300)
    fixed = deployment_options(s, RayOptions(replicas=3))
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    # probes and refusals still reach a full replica; the queue in front is bounded
    assert fixed["max_ongoing_requests"] == 8 + 4 and fixed["max_queued_requests"] == 16
    # Serve's kill comes only after duplexkit's drain and its session.closed
    assert fixed["graceful_shutdown_timeout_s"] == 300 + s.shutdown_grace_s + DRAIN_MARGIN_S
    auto = deployment_options(s, RayOptions(replicas=2, max_replicas=6, gpus_per_replica=1))
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"]["min_replicas"] == 2 and auto["autoscaling_config"]["max_replicas"] == 6
    assert auto["autoscaling_config"]["target_ongoing_requests"] == 6.0  # 0.75 * 8 sessions
    assert auto["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1}
    with pytest.raises(ValueError):
        RayOptions(replicas=3, max_replicas=2)


def test_the_drain_fits_in_serves_shutdown_timeout():
    s = ServerSettings(drain_s=300)
    ours = deployment_options(s, RayOptions())["graceful_shutdown_timeout_s"]
    assert drain_budget(s, ours) == 300  # duplexkit's own timeout leaves the whole drain
    assert drain_budget(s, 60) == 60 - s.shutdown_grace_s - DRAIN_MARGIN_S / 2  # a config file's lower one
    assert drain_budget(s, 3) == 0.0 and drain_budget(s, None) == 300


def test_gpus_per_replica_follow_the_layout():
    assert gpus_of_layout(None, "scripted") == 0
    assert gpus_of_layout("cpu", "tiny") == 0
    assert gpus_of_layout("1gpu", "/ckpt") == 1
    assert gpus_of_layout("2gpu", "/ckpt") == 2
    assert gpus_of_layout("3gpu", "/ckpt") == 3


def test_ray_replicas_without_ray_is_one_error_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError, as when not installed
    rc = main(["serve", "scripted", "--ray-replicas", "2", "--port", "0"])
    err = capsys.readouterr().err
    assert rc == EXIT_USAGE
    assert "--ray-replicas needs Ray Serve" in err and "duplexkit[ray]" in err


def test_ray_replicas_range_is_validated(capsys):
    with pytest.raises(SystemExit) as ei:
        main(["serve", "scripted", "--ray-replicas", "3-2"])
    assert ei.value.code == EXIT_USAGE and "MIN <= MAX" in capsys.readouterr().err


def test_the_serve_config_file_validates_and_builds():
    """deploy/ray/duplexkit.yaml against Ray Serve's own config schema; its args build the app."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (python -m pip install 'duplexkit[ray]')")
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from duplexkit.cli.ray_serve import app_builder

    path = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "duplexkit.yaml"
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (app,) = config.applications
    assert app.import_path == "duplexkit.cli.ray_serve:app_builder" and app.route_prefix == "/"
    built = app_builder({**app.args, "model": "scripted"})
    opts = built._bound_deployment._deployment_config
    assert opts.max_ongoing_requests == app.args["max_sessions"] + 4
    assert opts.autoscaling_config.min_replicas == app.args["replicas"]
    assert opts.autoscaling_config.max_replicas == app.args["max_replicas"]
    with pytest.raises(ValueError, match="unknown app_builder args"):
        app_builder({"model": "scripted", "max_sesions": 8})
