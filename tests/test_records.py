import time

import pytest

from p2ptrain.addrs import parse_multiaddr
from p2ptrain.records import ProgressRecord, SplitWatch, Vote, canonical_hash, global_round, view_hash


def rec(peer, round=0, state="training", h="aa", group=2, view=""):
    return ProgressRecord(
        view=view,
        seen=0,
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


def votes(*records):
    return [Vote.of(r) for r in records]


def test_canonical_hash_majority_then_group_then_smallest():
    assert canonical_hash(votes(rec("a", h="bb"), rec("b", h="aa"), rec("c", h="bb"))) == "bb"
    assert canonical_hash(votes(rec("a", h="bb", group=3), rec("b", h="aa", group=1))) == "bb"
    assert canonical_hash(votes(rec("a", h="bb"), rec("b", h="aa"))) == "aa"
    assert canonical_hash([]) is None


def test_params_nobody_serves_lose_a_tie_to_any_that_someone_serves():
    client = Vote("bb", last_group_size=3, serves=False)
    assert canonical_hash([client, Vote("cc", 1), Vote("aa", 1)]) == "aa"  # despite its larger group
    # Serving is a peer's own claim: it breaks ties, it never outvotes a majority.
    assert canonical_hash([client, client, Vote("cc", 1)]) == "bb"
    assert canonical_hash([client, Vote("bb", 1, serves=True)]) == "bb"  # one holder that serves is enough
    assert canonical_hash([client]) == "bb"


def test_split_watch_quiet_while_views_agree_or_differ_briefly():
    watch = SplitWatch(after_s=60)
    ids = {"a", "b", "c"}
    agree = {p: rec(p, view=view_hash(ids)) for p in ids}
    assert all(watch.observe(t, "a", 0, agree) is None for t in range(0, 300, 5))
    # c joined; b has not seen it yet for 30 s, then does: normal, no warning.
    stale_b = {**agree, "b": rec("b", view=view_hash({"a", "b"}))}
    assert all(watch.observe(t, "a", 0, stale_b) is None for t in range(300, 330, 5))
    assert watch.observe(330, "a", 0, agree) is None
    assert watch.observe(400, "a", 0, stale_b) is None  # a new disagreement starts its own clock


def test_split_watch_warns_when_a_peer_sees_another_swarm_for_too_long():
    watch = SplitWatch(after_s=60)
    ours = {"a", "b", "c"}
    records = {
        "a": rec("a", 4, view=view_hash(ours)),
        "b": rec("b", 4, view=view_hash(ours)),
        "c": rec("c", 4, view=view_hash({"c", "x", "y"})),  # c also sees x and y, which we never see
    }
    warnings = [watch.observe(t, "a", 4, records) for t in range(0, 150, 5)]
    fired = [w for w in warnings if w is not None]
    assert len(fired) == 2, "once when it has lasted 60 s, then at most once per 60 s"
    assert fired[0]["they_see"] == {"c": 0} and fired[0]["we_see"] == 3 and fired[0]["for_s"] == 60


def test_split_watch_warns_on_rounds_far_apart_but_not_one_apart():
    watch = SplitWatch(after_s=30)
    ids = {"a", "b"}
    one_apart = {"a": rec("a", 5, view=view_hash(ids)), "b": rec("b", 6, view=view_hash(ids))}
    assert all(watch.observe(t, "a", 5, one_apart) is None for t in range(0, 100, 5))
    far = {**one_apart, "b": rec("b", 8, view=view_hash(ids))}
    assert [w for w in (watch.observe(t, "a", 5, far) for t in range(100, 140, 5)) if w][0][
        "their_rounds"
    ] == {"b": 8}
    loading = {**one_apart, "b": rec("b", 0, state="loading", view=view_hash(ids))}
    assert all(watch.observe(t, "a", 5, loading) is None for t in range(200, 300, 5))


def test_a_record_names_no_peer_id_longer_than_libp2ps():
    """Every id a record names is at most MAX_PEER_ID characters (libp2p's are 46 to 53): with 128, a record
    of the largest size was a third larger (102 kB against 77 kB)."""
    import pydantic.v1

    from p2ptrain.records import MAX_PEER_ID

    ed25519 = "12D3KooWGPqLr56TyMWzcrRrD7qKoFtiSXvqtQdMqXhirUxDGfgh"
    assert rec(ed25519, 1).copy(update={"roster": [ed25519] * 256}).wire()
    longer = "Q" * (MAX_PEER_ID + 1)
    for fields in ({"peer_id": longer}, {"roster": [longer]}, {"group": [longer]}, {"replicas": [longer]}):
        wire = {**rec(ed25519, 1).wire(), **fields}
        with pytest.raises(pydantic.v1.ValidationError):
            ProgressRecord.parse_obj(wire)


def test_a_roster_names_one_class_per_member():
    """The roster a verifiable round's record names comes with each member's numeric class, in its order:
    the vote on the roster fixes the classes, so a record with a class too many or too few is refused."""
    import pydantic.v1

    wire = {**rec("a", 1).wire(), "roster": ["a", "b"], "roster_classes": ["cpu/float32", "cuda/bfloat16"]}
    assert ProgressRecord.parse_obj(wire).roster_classes == ["cpu/float32", "cuda/bfloat16"]
    for classes in (["cpu/float32"], ["cpu/float32"] * 3, []):
        with pytest.raises(pydantic.v1.ValidationError, match="roster_classes"):
            ProgressRecord.parse_obj({**wire, "roster_classes": classes})
    # A push leaves out what is at its default: a roster without its classes is refused too.
    with pytest.raises(pydantic.v1.ValidationError, match="roster_classes"):
        ProgressRecord.parse_obj({k: v for k, v in wire.items() if k != "roster_classes"})


def test_the_trainer_can_set_every_field_of_its_record_but_the_swarms():
    """The real swarm keeps what the trainer publishes in a LocalStatus: a record field it lacks made every
    verifiable round of real peers crash at its first claim (roster_classes, 2026-12-07), while the in-memory
    swarm, which kept a plain dict, trained on."""
    import dataclasses

    from p2ptrain.swarm import SET_BY_SWARM, LocalStatus, check_fields

    status = {f.name for f in dataclasses.fields(LocalStatus)}
    assert status | SET_BY_SWARM == set(ProgressRecord.__fields__) and not status & SET_BY_SWARM
    check_fields({name: None for name in status})
    with pytest.raises(AttributeError, match="no field 'nonsense'"):
        check_fields({"nonsense": 1})
