"""deploy/: the compose file, Prometheus config, Grafana provisioning, dashboard, Dockerfile and systemd unit
agree with each other and with the code (flags that exist, ports that are served, metrics that are defined)."""

import json
import re
import shlex
from pathlib import Path

import pytest
import typer.main
import yaml

from p2ptrain import telemetry
from p2ptrain.cli import app
from tests.conftest import ROOT

DEPLOY = ROOT / "deploy"


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def parse_cli(args: list[str]):
    """Parse a p2ptrain command line with the real CLI, without running it (unknown flags raise)."""
    group = typer.main.get_command(app)
    name, *rest = args
    command = group.commands[name]
    return command.make_context(name, list(rest), resilient_parsing=False)


def flag(args: list[str], name: str) -> str:
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} not in {args}")


def test_compose_services_run_real_commands_with_init(compose):
    services = compose["services"]
    assert {"dht", "peer1", "peer2", "prometheus", "grafana"} <= services.keys()
    for name in ("dht", "peer1", "peer2"):
        service = services[name]
        assert service["init"] is True, f"{name}: PID 1 must forward signals and reap hivemind's children"
        ctx = parse_cli(service["command"])
        assert ctx.params["metrics_port"] == 9100
    assert services["dht"]["command"][0] == "dht" and services["peer1"]["command"][0] == "join"


def test_peers_find_the_bootstrap_node_through_the_shared_file(compose):
    services = compose["services"]
    written = flag(services["dht"]["command"], "--maddrs-file")
    for peer in ("peer1", "peer2"):
        sets = [a.split("=", 1)[1] for a in services[peer]["command"] if a.startswith("--set=")]
        assert f"swarm.initial_peers_file={written}" in sets
        mounts = {v.split(":")[1]: v.split(":")[0] for v in services[peer]["volumes"]}
        assert mounts[str(Path(written).parent)] == "bootstrap"
    assert "bootstrap:/bootstrap" in services["dht"]["volumes"]


def test_prometheus_scrapes_the_ports_the_services_serve(compose):
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    served = {
        f"{name}:{parse_cli(s['command']).params['metrics_port']}"
        for name, s in compose["services"].items()
        if "command" in s and s["command"][0] in ("dht", "join")
    }
    assert targets == served
    prometheus = compose["services"]["prometheus"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_grafana_provisions_the_datasource_and_dashboard_the_dashboard_uses(compose):
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/p2ptrain.yml").read_text())
    mounts = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    assert mounts[provider["providers"][0]["options"]["path"]] == "./grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    dashboard = json.loads((DEPLOY / "grafana/dashboards/p2ptrain.json").read_text())
    uids = {p["datasource"]["uid"] for p in dashboard["panels"]}
    uids |= {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {uid}


def dashboard_metric_names() -> set[str]:
    dashboard = json.loads((DEPLOY / "grafana/dashboards/p2ptrain.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return {m for e in exprs for m in re.findall(r"\bp2ptrain_[a-z_]+\b", e)}


def exposed_sample_names(families) -> set[str]:
    return {s.name for f in families for s in f.samples}


def test_dashboard_uses_only_defined_metrics_and_shows_what_matters():
    names = dashboard_metric_names()
    defined = exposed_sample_names(telemetry.REGISTRY.collect())
    assert names <= defined, f"undefined: {sorted(names - defined)}"
    for needed in (
        "p2ptrain_train_loss",
        "p2ptrain_swarm_samples_per_second",
        "p2ptrain_swarm_peers",
        "p2ptrain_averaging_sent_bytes_total",
        "p2ptrain_outer_step_failures_total",
        "p2ptrain_outer_step_duration_seconds_bucket",
    ):
        assert needed in names


def test_dockerfile_runs_as_a_user_with_a_data_volume():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^USER p2ptrain$", text, re.M) and 'ENTRYPOINT ["p2ptrain"]' in text
    assert 'VOLUME ["/data"]' in text and "P2PTRAIN_SWARM__IDENTITY_PATH=/data/identity.key" in text
    assert "EXPOSE 31337 9100" in text


def test_systemd_unit_restarts_keeps_state_and_gpu_access():
    unit = (DEPLOY / "p2ptrain.service").read_text()
    settings = dict(
        line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#")
    )
    assert settings["Restart"] == "on-failure" and settings["StateDirectory"] == "p2ptrain"
    assert settings["KillSignal"] == "SIGTERM"
    assert "PrivateDevices" not in settings and "DevicePolicy" not in settings, "GPUs must stay reachable"
    assert "MemoryDenyWriteExecute" not in settings, "CUDA and torch's JIT need writable+executable memory"
    exec_start = shlex.split(settings["ExecStart"])
    assert exec_start[0].endswith("/p2ptrain")
    ctx = parse_cli(exec_start[1:])
    assert ctx.params["metrics_port"] == 9100


def test_the_bootstrap_node_watches_the_run_the_peers_train(compose):
    from p2ptrain.config import ExperimentConfig

    watched = parse_cli(compose["services"]["dht"]["command"]).params["run_id"]
    peer_sets = [a for a in compose["services"]["peer1"]["command"] if a.startswith("--set=run.run_id")]
    assert watched == ExperimentConfig().run.run_id and not peer_sets


def test_the_volunteer_example_config_is_valid_and_joins_somewhere():
    from p2ptrain.config import load_config

    cfg = load_config(DEPLOY / "experiment.example.yaml")
    assert cfg.swarm.initial_peers and cfg.checkpoint.every_rounds > 0
    unit = (DEPLOY / "p2ptrain.service").read_text()
    assert "--config /etc/p2ptrain/experiment.yaml" in unit
