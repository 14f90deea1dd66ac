"""The dashboard's PromQL subset (tests/promql.py), against hand-computed values."""

import math

import pytest

from tests.promql import PromQLError, Scrapes, evaluate


def labels(**kv):
    return tuple(sorted(kv.items()))


PEER_A, PEER_B, NODE = labels(job="peers", instance="a"), labels(job="peers", instance="b"), labels(job="dht")
BEFORE = {
    ("loss", PEER_A): 3.0,
    ("loss", PEER_B): 2.0,
    ("steps_total", PEER_A): 10.0,
    ("steps_total", PEER_B): 20.0,
    ("peers", labels(job="dht", state="training")): 2.0,
    **{
        ("t_bucket", labels(job="peers", instance="a", le=le)): c
        for le, c in (("1.0", 0), ("2.0", 0), ("+Inf", 0))
    },
}
AFTER = {
    **BEFORE,
    ("loss", PEER_A): 2.5,
    ("steps_total", PEER_A): 40.0,
    ("steps_total", PEER_B): 30.0,
    ("peers", labels(job="dht", state="averaging")): 1.0,
    **{
        ("t_bucket", labels(job="peers", instance="a", le=le)): c
        for le, c in (("1.0", 2), ("2.0", 4), ("+Inf", 4))
    },
}
SCRAPES = Scrapes(BEFORE, AFTER, seconds=10.0)


def test_selectors_aggregations_and_rates():
    assert evaluate("min(loss)", SCRAPES).series == {(): 2.0}
    assert evaluate('loss{instance="a"}', SCRAPES).series == {PEER_A: 2.5}
    assert evaluate("sum(rate(steps_total[$__rate_interval]))", SCRAPES).series == {(): 4.0}
    assert evaluate("increase(steps_total[5m])", SCRAPES).series == {PEER_A: 30.0, PEER_B: 10.0}
    by_state = evaluate('sum by (state) (peers{job="dht"})', SCRAPES).series
    assert by_state == {(("state", "averaging"),): 1.0, (("state", "training"),): 2.0}


def test_histogram_quantile_interpolates_within_the_bucket():
    q = evaluate("histogram_quantile(0.5, sum by (le) (rate(t_bucket[$__rate_interval])))", SCRAPES).series
    assert q[()] == pytest.approx(1.0)  # 2 of 4 observations at or below 1 s
    q90 = evaluate("histogram_quantile(0.9, sum by (le) (rate(t_bucket[1m])))", SCRAPES).series[()]
    assert q90 == pytest.approx(1.8)  # 3.6 of 4: 80% of the way from 1 s to 2 s
    empty = Scrapes(BEFORE, BEFORE, seconds=10.0)
    assert math.isnan(evaluate("histogram_quantile(0.5, sum by (le) (rate(t_bucket[1m])))", empty).series[()])


def test_matched_series_say_where_a_value_comes_from():
    result = evaluate("min(loss)", SCRAPES)
    assert {dict(labels)["instance"] for _, labels in result.matched} == {"a", "b"}


@pytest.mark.parametrize("query", ["avg(loss)", "loss + 1", 'loss{job=~"p.*"}', "topk(1, loss)"])
def test_anything_else_is_refused_not_misread(query):
    with pytest.raises(PromQLError):
        evaluate(query, SCRAPES)


def test_the_dashboards_swarm_panels_count_the_swarm_once_however_many_bootstrap_nodes_report_it():
    # docs/deploy.md advises two or three bootstrap nodes; each exports the same swarm's gauges.
    import json

    from tests.conftest import ROOT

    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/p2ptrain.json").read_text())
    exprs = [
        t["expr"] for p in dashboard["panels"] for t in p["targets"] if "p2ptrain_swarm_peers" in t["expr"]
    ]
    nodes = {
        ("p2ptrain_swarm_peers", labels(job="p2ptrain-dht", instance=node, state=state)): count
        for node in ("dht1:9100", "dht2:9100")
        for state, count in (("training", 3.0), ("averaging", 1.0))
    }
    scrapes = Scrapes(nodes, nodes, 15.0)
    results = [evaluate(expr, scrapes).series for expr in exprs]
    assert {(): 4.0} in results  # peers alive
    assert {labels(state="training"): 3.0, labels(state="averaging"): 1.0} in results  # peers by state
    assert len(results) == 2
