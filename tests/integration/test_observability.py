"""A real swarm, as a user sets one up and watches it: a `p2ptrain dht` bootstrap node and two `p2ptrain join`
peers train to the end together; /metrics of the peers and the node, `status --json` and the JSON logs
show it while it runs."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from p2ptrain import checkpoint
from tests.conftest import ROOT
from tests.integration.conftest import LOOPBACK, join_args, val_losses
from tests.promql import Scrapes, evaluate
from tests.test_deploy import dashboard_metric_names, exposed_sample_names

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> list:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return list(text_string_to_metric_families(text))


def value(families, name: str, **labels) -> float | None:
    for f in families:
        for s in f.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def scrape_all(ports: list[int], dht_port: int, peer0, peer1=None) -> dict:
    """Every sample of the two peers and the node, labelled as deploy/prometheus.yml's jobs label them."""
    targets = [
        ("p2ptrain-peers", ports[0], peer0),
        ("p2ptrain-peers", ports[1], peer1),
        ("p2ptrain-dht", dht_port, None),
    ]
    samples = {}
    for job, port, families in targets:
        for family in families or scrape(port):
            for sample in family.samples:
                labels = {**sample.labels, "job": job, "instance": f"127.0.0.1:{port}"}
                samples[(sample.name, tuple(sorted(labels.items())))] = sample.value
    return samples


def dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "p2ptrain.json").read_text())
    return [(p["title"], t["expr"]) for p in dashboard["panels"] for t in p.get("targets", [])]


def poll(fn, timeout_s: float = 90, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
            if last:
                return last
        except OSError:  # the server is not up yet
            pass
        time.sleep(every_s)
    raise AssertionError(f"condition not met within {timeout_s}s (last: {last})")


def test_metrics_status_and_logs_of_a_two_peer_swarm(tmp_path, spawn):
    run_id = f"t{uuid.uuid4().hex[:8]}"
    dht_port, ports = free_port(), [free_port(), free_port()]
    node = spawn(
        "dht",
        "--host-maddrs",
        LOOPBACK,
        "--log-format",
        "json",
        # Told no run: its metrics follow the swarm's only published run (the peers' run_id below).
        "--metrics-port",
        str(dht_port),
        "--set",
        "metrics.host=127.0.0.1",
        "--set",
        "metrics.swarm_period_s=0.5",
        name="dht",
    )
    maddr = node.wait_for_maddr()
    rounds = 40  # long enough that `status` (a process that joins the DHT: seconds) reads while they train
    long = ["--set", f"outer.num_rounds={rounds}", "--set", "inner.num_inner_steps=40"]
    long += ["--set", "metrics.host=127.0.0.1", "--set", "averaging.target_group_size=2"]
    peers = [
        spawn(
            *join_args(
                tmp_path, f"p{i}", run_id, "--initial-peers", maddr, "--set", "swarm.min_peers=2", *long
            ),
            "--metrics-port",
            str(ports[i]),
            name=f"p{i}",
        )
        for i in range(2)
    ]

    # The peers' series move as training proceeds.
    first = poll(lambda: (f := scrape(ports[0])) and (value(f, "p2ptrain_outer_steps_total") or 0) >= 1 and f)
    t_first, first_all_families = time.monotonic(), [first, scrape(ports[1])]
    first_all = scrape_all(ports, dht_port, *first_all_families)
    # `status --json`, while they train: a reader process that joins the DHT and leaves.
    status_cmd = [sys.executable, "-m", "p2ptrain", "status", "--initial-peers", maddr, "--run-id", run_id]
    # In a peer's container the image sets the peer's identity file: a reader must never take it (it would
    # be the peer's double in the DHT), nor make one there.
    identity = tmp_path / "identity-of-a-peer.key"
    status_proc = subprocess.Popen(
        [*status_cmd, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "P2PTRAIN_SWARM__IDENTITY_PATH": str(identity)},
    )

    def moved(name: str, f) -> bool:
        return value(f, name) > value(first, name)

    # Metrics are not read atomically (an outer step may land between two counters): wait for both to move.
    # The histograms too: then every rate the dashboard takes has observations on both peers.
    names = (
        "p2ptrain_outer_steps_total",
        "p2ptrain_inner_steps_total",
        "p2ptrain_samples_total",
        "p2ptrain_inner_step_duration_seconds_count",
        "p2ptrain_outer_step_duration_seconds_count",
        "p2ptrain_outer_sync_duration_seconds_count",
    )
    later = poll(lambda: (f := scrape(ports[0])) and all(moved(n, f) for n in names) and f)
    later_1 = poll(
        lambda: (
            (f := scrape(ports[1]))
            and all(value(f, n) > value(first_all_families[1], n) for n in names)
            and f
        )
    )
    later_all = scrape_all(ports, dht_port, later, later_1)
    dashboard = Scrapes(first_all, later_all, seconds=time.monotonic() - t_first)
    assert value(later, "p2ptrain_averaging_sent_bytes_total") > 0
    assert value(later, "p2ptrain_round") >= 2
    assert 0 < value(later, "p2ptrain_train_loss") < 6
    assert value(later, "p2ptrain_outer_step_duration_seconds_count") >= 2
    assert value(later, "p2ptrain_peer_info", device="cpu", run_id=run_id) == 1

    # The bootstrap node, which trains nothing, sees the whole swarm in the DHT records.
    swarm = poll(
        lambda: (
            (f := scrape(dht_port))
            and sum(value(f, "p2ptrain_swarm_peers", state=s) or 0 for s in ("training", "averaging")) == 2
            and f
        )
    )
    assert value(swarm, "p2ptrain_swarm_samples_per_second") > 0
    assert value(swarm, "p2ptrain_swarm_round") >= 1

    # `status --json` lists both peers.
    stdout, stderr = status_proc.communicate(timeout=90)
    assert status_proc.returncode == 0, stderr.decode()[-2000:]
    assert not identity.exists()
    status = json.loads(stdout)
    peer_ids = {p.peer_id() for p in peers}

    def status_of_both():
        # One read of the DHT: a record stored a moment ago may not be on the nodes it asked yet (a reader
        # sees it on its next read, as a person running `p2ptrain status` again would).
        nonlocal status
        if {p["short_id"] for p in status["peers"]} != peer_ids:
            out = subprocess.run([*status_cmd, "--json"], capture_output=True, timeout=90)
            assert out.returncode == 0, out.stderr.decode()[-2000:]
            status = json.loads(out.stdout)
        return {p["short_id"] for p in status["peers"]} == peer_ids

    poll(status_of_both)
    assert status["round"] >= 1 and all(p["device"] == "cpu" for p in status["peers"])
    # Each peer's device benchmark and contribution (the tiny config benchmarks 3 steps at start).
    assert all(p["benchmark_samples_per_s"] > 0 and p["benchmark_gflops"] > 0 for p in status["peers"])
    assert all(p["compute_s"] > 0 and p["rounds_contributed"] >= 1 for p in status["peers"]), status["peers"]

    # Everything the dashboard draws exists on a live endpoint.
    live = exposed_sample_names(later) | exposed_sample_names(swarm)
    assert dashboard_metric_names() <= live, sorted(dashboard_metric_names() - live)
    # The node that does not train exports no series of a peer's own (no loss of 0 in "Validation loss").
    node_names = {s.name for f in swarm for s in f.samples}
    assert not node_names & {"p2ptrain_validation_loss", "p2ptrain_train_loss", "p2ptrain_round"}, node_names
    # Every query of the dashboard, as Prometheus would evaluate it over these scrapes: each panel shows
    # something, and what a panel reads from the node is swarm-wide, never a peer's own series.
    for title, expr in dashboard_queries():
        result = evaluate(expr, dashboard)
        assert result.series, f"{title}: {expr} shows nothing"
        assert all(math.isfinite(v) for v in result.series.values()), (title, expr, result.series)
        from_node = {name for name, labels in result.matched if dict(labels)["job"] == "p2ptrain-dht"}
        assert all(name.startswith("p2ptrain_swarm_") for name in from_node), (title, expr, from_node)
    assert min(evaluate("min(p2ptrain_validation_loss)", dashboard).series.values()) > 0.5

    for p in peers:
        assert p.wait(180) == 0, p.tail()
        assert "Final model:" in p.stdout()
    # They trained together to the end.
    finals = [checkpoint.load(tmp_path / f"p{i}" / "final.safetensors") for i in range(2)]
    assert finals[0].round == finals[1].round == rounds
    assert finals[0].params_sha256() == finals[1].params_sha256()
    assert any(s["group_size"] == 2 for s in peers[0].outer_steps())  # they really averaged together
    initial, final = val_losses(finals[0])
    assert final < initial - 0.5, f"validation loss {initial:.4f} -> {final:.4f}"
    # Piped logs are JSON lines, each with run_id and peer_id bound; outer-step lines carry the round.
    for p in peers:
        lines = p.log_path.read_text().splitlines()
        events = [json.loads(line) for line in lines]  # every line, not only those that look like JSON
        assert all(e["run_id"] == run_id for e in events)
        config = next(e for e in events if e["event"] == "config")  # a summary, not the whole config
        assert config["model"] == "gpt-nano" and "averaging" not in config and "swarm" not in config
        assert all("peer_id" in e for e in events if e["event"] != "config")
        steps = [e for e in events if e["event"] == "outer step"]
        assert 1 <= len(steps) <= rounds and all(
            {"round", "train_loss", "samples", "group_size", "bytes_sent", "duration_s"} <= e.keys()
            for e in steps
        )


def test_metrics_on_a_taken_port_or_an_unknown_host_are_one_line_naming_the_setting():
    from prometheus_client import CollectorRegistry

    from p2ptrain import telemetry
    from p2ptrain.config import ConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            ConfigError, match=rf"^metrics.port {port} on metrics.host 127.0.0.1: cannot serve"
        ):
            telemetry.serve(port, "127.0.0.1", registry=CollectorRegistry())
    with pytest.raises(ConfigError, match=r"metrics.host 999.1.1.1: cannot serve .*; set metrics.host$"):
        telemetry.serve(free_port(), "999.1.1.1", registry=CollectorRegistry())
