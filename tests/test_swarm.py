import time

import pytest

from p2ptrain.swarm import ProgressRecord, canonical_hash, global_round, parse_multiaddr


def rec(peer, round=0, state="training", h="aa", group=2):
    return ProgressRecord(
        peer_id=peer,
        round=round,
        state=state,
        params_hash=h,
        samples_round=0,
        samples_total=0,
        samples_per_s=0.0,
        last_group_size=group,
        device="cpu",
        time=time.time(),
    )


def test_parse_multiaddr_accepts_real_addresses():
    parse_multiaddr("/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWGPqLr56TyMWzcrRrD7qKoFtiSXvqtQdMqXhirUxDGfgh")
    parse_multiaddr("/ip4/0.0.0.0/tcp/0")


@pytest.mark.parametrize("bad", ["127.0.0.1:31337", "/ip4/999.1.1.1/tcp/1", "/ip4/1.2.3.4/tcp/notaport", ""])
def test_parse_multiaddr_rejects_with_reason(bad):
    with pytest.raises(ValueError, match="multiaddr"):
        parse_multiaddr(bad)


def test_global_round_ignores_loading_peers():
    records = {"a": rec("a", 3), "b": rec("b", 5, state="loading"), "c": rec("c", 4)}
    assert global_round(records) == 4
    assert global_round({}) == -1


def test_canonical_hash_majority_then_group_then_smallest():
    assert canonical_hash([rec("a", h="bb"), rec("b", h="aa"), rec("c", h="bb")]) == "bb"
    assert canonical_hash([rec("a", h="bb", group=3), rec("b", h="aa", group=1)]) == "bb"
    assert canonical_hash([rec("a", h="bb"), rec("b", h="aa")]) == "aa"
    assert canonical_hash([]) is None
