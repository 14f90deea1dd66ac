"""A swarm split on a real network: 3 peers, each in a network namespace of its own, lose each other (every
link of their bridge down) for longer than their barrier timeout, then see each other again. They must come
back together and end with one model (bench/split.py measures the same with 4 peers)."""

from __future__ import annotations

import pytest

from bench import split
from bench.netns import available

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(available() is not None, reason=f"no network namespaces here: {available()}"),
]


def test_peers_cut_off_from_each_other_come_back_together_and_end_with_one_model(tmp_path):
    """Before 2026-12-08 they never did: every node's DHT routing table had emptied (hivemind drops a node
    whose calls fail, and never asks its initial peers again), so nobody found anybody after the outage, and
    each peer trained alone to the end, with a model of its own (board.rejoin)."""
    result = split.run("test", [], rounds=40, at_round=3, seconds=12, workdir=tmp_path, peers=3)
    assert result["exit_codes"] == [0, 0, 0], result
    assert result["cut_s"] is not None, "the run ended before the links came back"
    together = result["first_round_all_together_after_the_cut"]
    assert together is not None, result["group_sizes"]
    # Rounds after the cut began and before they met again were not averaged by all three: it did cut.
    assert any(result["group_sizes"][str(r)] != [3, 3, 3] for r in range(4, together)), result["group_sizes"]
    assert result["one_final_model"], result
