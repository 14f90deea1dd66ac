"""Metrics are defined once, named by Prometheus conventions, served and parseable, and the swarm gauges
follow the records."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from p2ptrain import telemetry
from tests.test_records import rec


def ours():
    return [m for m in telemetry.REGISTRY.collect() if m.name.startswith("p2ptrain_")]


def test_metric_names_follow_prometheus_conventions():
    families = ours()
    assert len(families) >= 20
    for family in families:
        if family.type == "counter":
            assert not family.name.endswith("_total"), "prometheus-client appends _total itself"
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), f"{family.name}: histograms here measure seconds"
        if "bytes" in family.name:
            assert family.name.endswith("_bytes"), family.name
        assert family.documentation, f"{family.name} has no help text"
    # No per-remote-peer labels: only small, fixed label sets.
    labels = {s.name: set(s.labels) - {"le"} for f in families for s in f.samples}
    assert {k for v in labels.values() for k in v} <= {
        "reason",
        "phase",
        "outcome",
        "state",
        "peer_id",
        "run_id",
        "device",
        "model",
        "python",
        "torch",
        "hivemind",
    }


def test_round_buckets_cover_seconds_to_an_hour():
    assert telemetry.ROUND_BUCKETS[0] <= 1 and telemetry.ROUND_BUCKETS[-1] >= 3600


def test_swarm_gauges_follow_the_records():
    records = {
        "a": rec("a", 4, state="training"),
        "b": rec("b", 4, state="averaging"),
        "c": rec("c", 0, state="loading"),
    }
    records["a"].samples_per_s, records["b"].samples_per_s = 10.0, 5.5
    records["a"].samples_total, records["b"].samples_total = 100, 50
    telemetry.observe_swarm(records)
    value = telemetry.REGISTRY.get_sample_value
    assert value("p2ptrain_swarm_peers", {"state": "training"}) == 1
    assert value("p2ptrain_swarm_peers", {"state": "loading"}) == 1
    assert value("p2ptrain_swarm_round") == 4
    assert value("p2ptrain_swarm_samples_per_second") == 15.5
    assert value("p2ptrain_swarm_samples") == 150


def test_exposed_metrics_parse_with_prometheus_own_parser():
    # The served endpoint itself is scraped in tests/integration/test_observability.py.
    telemetry.OUTER_STEP_FAILURES.labels(reason="no_group").inc()
    text = generate_latest(telemetry.REGISTRY).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"p2ptrain_inner_steps", "p2ptrain_outer_step_failures", "p2ptrain_swarm_peers"} <= names
    assert 'p2ptrain_outer_step_failures_total{reason="no_group"}' in text
    for reason in telemetry.FAILURE_REASONS:  # every reason's series exists from the start, so rate() works
        assert f'p2ptrain_outer_step_failures_total{{reason="{reason}"}}' in text


def test_the_bootstrap_node_exports_only_swarm_wide_series():
    """A node that does not train must not export a peer's series at 0 (a dashboard's min() would pick it)."""
    telemetry.VALIDATION_LOSS.set(2.0)
    node = {m.name for m in telemetry.NODE.collect() if m.name.startswith("p2ptrain_")}
    peer = {m.name for m in telemetry.REGISTRY.collect() if m.name.startswith("p2ptrain_")}
    assert node == {"p2ptrain_peer", *(n for n in peer if n.startswith("p2ptrain_swarm_"))}
    assert {"p2ptrain_validation_loss", "p2ptrain_round", "p2ptrain_train_loss"} <= peer - node


def test_validation_loss_is_absent_until_the_peer_evaluates(monkeypatch):
    """With data.eval_by 'one' a peer evaluates in turn: before its first turn it shows no loss, never 0."""
    monkeypatch.setattr(telemetry.VALIDATION_LOSS, "value", None)
    names = lambda: {m.name for m in telemetry.REGISTRY.collect()}  # noqa: E731
    assert "p2ptrain_validation_loss" not in names()
    telemetry.VALIDATION_LOSS.set(3.25)
    assert "p2ptrain_validation_loss" in names()
    assert "p2ptrain_validation_loss 3.25" in generate_latest(telemetry.REGISTRY).decode()
