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


def test_dashboard_uses_only_defined_metrics_and_shows_what_matters(monkeypatch):
    names = dashboard_metric_names()
    monkeypatch.setattr(telemetry.VALIDATION_LOSS, "value", 2.0)  # a reading, absent until it is taken
    defined = exposed_sample_names(telemetry.REGISTRY.collect())
    assert names <= defined, f"undefined: {sorted(names - defined)}"
    for needed in (
        "p2ptrain_train_loss",
        "p2ptrain_swarm_samples_per_second",
        "p2ptrain_swarm_peers",
        "p2ptrain_averaging_sent_bytes_total",
        "p2ptrain_outer_step_failures_total",
        "p2ptrain_outer_step_duration_seconds_bucket",
        "p2ptrain_averaging_outlier_parts_total",
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


def test_systemd_unit_security_exposure_is_at_most_3_5(tmp_path):
    """`systemd-analyze security --offline` rates the unit's sandboxing (0 best, 10 worst)."""
    import shutil
    import subprocess

    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here")
    unit = tmp_path / "p2ptrain.service"  # the tool wants a unit file name; the copy keeps the repo clean
    unit.write_text((DEPLOY / "p2ptrain.service").read_text())
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for p2ptrain.service: ([0-9.]+)", out.stdout + out.stderr)
    assert match, out.stdout[-2000:] + out.stderr[-2000:]
    assert float(match.group(1)) <= 3.5, out.stdout


def test_compose_swarm_keeps_running_and_starts_in_order(compose):
    services = compose["services"]
    dht_file = flag(services["dht"]["command"], "--maddrs-file")
    assert dht_file in services["dht"]["healthcheck"]["test"], "the node is healthy once peers can find it"
    for name in ("peer1", "peer2"):
        peer = services[name]
        assert peer["depends_on"]["dht"]["condition"] == "service_healthy"
        ctx = parse_cli(peer["command"])
        assert ctx.params["rounds"] >= 10_000, "a long-running swarm, not one that stops after 16 rounds"
        assert f"127.0.0.1:{ctx.params['metrics_port']}/metrics" in " ".join(peer["healthcheck"]["test"])
        port = ctx.params["host_maddrs"][0].rsplit("/", 1)[1]
        assert f"{port}:{port}" in peer["ports"], f"{name}: others reach it through its published port"


@pytest.mark.parametrize("announce", ["[]", '["/dns4/peer1/tcp/31338", "/ip4/203.0.113.5/tcp/31338"]'])
def test_compose_announce_addresses_are_valid_config(compose, monkeypatch, announce):
    from p2ptrain.config import load_config

    for name in ("dht", "peer1", "peer2"):
        value = compose["services"][name]["environment"]["P2PTRAIN_SWARM__ANNOUNCE_MADDRS"]
        assert value.endswith(":-[]}"), "unset, a service announces nothing extra"
    monkeypatch.setenv("P2PTRAIN_SWARM__ANNOUNCE_MADDRS", announce)
    assert load_config().swarm.announce_maddrs == json.loads(announce)


def test_the_image_creates_its_volumes_owned_by_the_user_it_runs_as(compose):
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    user = re.search(r"^USER (\S+)", dockerfile, re.M).group(1)
    volumes = {v.split(":")[1] for s in ("dht", "peer1", "peer2") for v in compose["services"][s]["volumes"]}
    run = " ".join(re.findall(r"^RUN (.+?)(?<!\\)$", dockerfile.replace("\\\n", " "), re.M | re.S))
    for path in sorted(volumes):
        # A new named volume copies the image directory's owner: a missing one is root's, unwritable for `user`.
        assert re.search(rf"mkdir [^&]*{path}\b", run), f"the image must create {path}"
        assert re.search(rf"chown {user}:{user} [^&]*{path}\b", run), f"{path} must belong to {user}"
    assert "P2PTRAIN_METRICS__HOST=0.0.0.0" in dockerfile, "Prometheus scrapes from another container"
