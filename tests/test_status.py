"""`p2ptrain status`: the summary of the swarm's records, as JSON for scripts and a table for people."""

from p2ptrain.status import render, summarize
from tests.test_records import rec


def test_summary_lists_every_peer_with_round_throughput_and_contribution():
    a, b = rec("12D3KooWaaaaaaaaPEER0001", 5), rec("12D3KooWbbbbbbbbPEER0002", 5, state="averaging")
    a.samples_per_s, b.samples_per_s, a.samples_total, b.samples_total = 100.0, 50.0, 4000, 2000
    a.time = b.time = 1000.0
    loading = rec("12D3KooWccccccccPEER0003", 0, state="loading")
    loading.time = 998.0
    summary = summarize("run-x", {r.peer_id: r for r in (a, b, loading)}, now=1001.5)
    assert summary["round"] == 5 and summary["samples_per_s"] == 150.0 and summary["samples_total"] == 6000
    assert [p["short_id"] for p in summary["peers"]] == ["PEER0001", "PEER0002", "PEER0003"]
    assert summary["peers"][0]["last_seen_s"] == 1.5 and summary["peers"][2]["state"] == "loading"
    text = render(summary)
    assert text.splitlines()[0].startswith("run run-x: 3 live peer(s), round 5, 150.0 samples/s")
    assert "PEER0002" in text and "averaging" in text and "4,000" in text


def test_status_shows_each_peers_device_benchmark_and_what_it_contributed():
    a, b = rec("12D3KooWaaaaaaaaPEER0001", 5), rec("12D3KooWbbbbbbbbPEER0002", 5)
    a.benchmark_samples_per_s, a.benchmark_flops, a.compute_s, a.rounds_contributed = (
        410.0,
        2.1e10,
        5400.0,
        90,
    )
    b.compute_s, b.rounds_contributed = 42.0, 3  # no benchmark (device.benchmark_steps 0)
    summary = summarize("run-z", {r.peer_id: r for r in (a, b)})
    first = summary["peers"][0]
    assert (first["benchmark_samples_per_s"], first["benchmark_gflops"]) == (410.0, 21.0)
    assert (first["compute_s"], first["rounds_contributed"]) == (5400.0, 90) and summary[
        "compute_s"
    ] == 5442.0
    lines = render(summary).splitlines()
    assert "1.5 h of compute so far" in lines[0]
    row_a = next(line for line in lines if "PEER0001" in line)
    row_b = next(line for line in lines if "PEER0002" in line)
    assert "410/s, 21.0 GFLOP/s" in row_a and "1.5 h" in row_a and " 90 " in row_a
    assert " - " in row_b and "42 s" in row_b


def test_a_peers_strings_are_shown_as_text_never_as_markup_or_terminal_escapes():
    # Records come from other peers: a device of '[/bold]' made rich raise; an escape would clear the screen.
    a, b = rec("12D3KooWaaaaaaaaPEER0001", 5), rec("12D3KooWbbbbbbbbPEER0002", 5)
    a.device, b.device = "[/bold]", "\x1b[2Jcpu"
    text = render(summarize("run-m", {r.peer_id: r for r in (a, b)}))
    assert "[/bold]" in next(line for line in text.splitlines() if "PEER0001" in line)
    assert "\x1b" not in text and "?[2Jcpu" in text


def test_empty_swarm_is_said_plainly():
    summary = summarize("run-y", {})
    assert summary["peers"] == [] and summary["round"] == -1
    assert render(summary).startswith("run run-y: 0 live peer(s), no round yet,")


def test_a_verifiable_run_shows_each_peers_shard_trust_strikes_and_bans_as_the_records_report_them():
    a, b, x = (rec(f"12D3KooW{c * 8}PEER000{i}", 5) for i, c in enumerate("abx"))
    for r in (a, b, x):
        r.time = 1000.0
    a.shard, a.replicas = "0/2", [a.peer_id, b.peer_id]
    b.shard, b.replicas = "0/2", [a.peer_id, b.peer_id]
    a.trusted = b.trusted = ["PEER0000", "PEER0001"]
    a.struck = b.struck = ["PEER0002:2"]
    a.banned = b.banned = ["PEER0002"]
    summary = summarize("run-v", {r.peer_id: r for r in (a, b, x)}, now=1000.0)
    by_id = {p["short_id"]: p["verification"] for p in summary["peers"]}
    assert summary["verifiable"]
    assert by_id["PEER0000"] == {
        "shard": "0/2",
        "replicas": ["PEER0000", "PEER0001"],
        "trusted_by": 2,
        "strikes": 0,
        "banned_by": 0,
        "reporters": 2,
    }
    assert by_id["PEER0002"]["strikes"] == 2 and by_id["PEER0002"]["banned_by"] == 2
    text = render(summary)
    assert "banned by" in text and text.splitlines()[-1].split()[-4:] == ["-", "0/2", "2", "2/2"]
    assert not summarize("run-w", {a.peer_id: rec(a.peer_id, 5)})["verifiable"]
