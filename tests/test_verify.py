"""Verification by replicas, the pure parts: commitments, sketches, verdicts, referees."""

from __future__ import annotations

import json

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import NoCompression

from p2ptrain.compression import deserialize, make_codec, wire_parts
from p2ptrain.records import ProgressRecord
from p2ptrain.verify import (
    MAX_DONATED_DISPUTE_BYTES,
    MAX_TOLERANCE,
    SKETCH_WIDTH,
    ByClass,
    Claim,
    Dispute,
    Member,
    Outcome,
    Report,
    Reputation,
    Sealed,
    Why,
    assign,
    assignment_seed,
    calibrate,
    commitment,
    disputes,
    distance,
    donated,
    group_seed,
    judge,
    judge_round,
    parse_shard,
    part_digest,
    part_sketch,
    referee_for,
    refereed,
    sealed,
    sealed_parts,
    sent_problem,
    sketch,
    sketch_layout,
    sketch_seed,
    swarm_reputation,
    tolerance,
    wire,
)
from tests.test_records import rec


def delta(seed: int, size: int = 50_000) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=gen), torch.randn(7, 3, generator=gen)]


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def nearby(tensors, relative: float, seed: int = 99) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    noise = [torch.randn(t.shape, generator=gen) for t in tensors]
    scale = relative * float(flat(tensors).norm()) / float(flat(noise).norm())
    return [t + scale * n for t, n in zip(tensors, noise)]


INT8 = make_codec("int8")


def report(peer: str, tensors, seed: int, numeric_class: str = "cpu/float32") -> Report:
    """A replica's report on what it sends (the default wire: int8)."""
    parts = wire(tensors, INT8).parts
    return Report(peer, numeric_class, sketch(parts, seed), float(flat(parts).norm()))


def test_the_wire_is_hiveminds_cut_and_its_digests_change_with_any_byte_sent():
    size = 2**16  # bytes on the wire per part (hivemind's default is 512 KiB)
    codec = make_codec("int8", small_tensor_numel=64, part_size_bytes=size)
    d = [*delta(0, size=300_000), torch.randn(40)]
    # The cut is hivemind's, whatever the group: parts of 3 reducers, in order, are the wire's parts.
    container = TensorPartContainer(d, [0.5, 0.2, 0.3], codec, size, return_deltas=False)
    theirs = [part for parts in container._input_parts_by_peer for part, _ in parts]
    ours = [part for part, _ in wire_parts(d, codec, size)]
    assert len(ours) == len(theirs) > len(d) and all(torch.equal(a, b) for a, b in zip(ours, theirs))
    w = wire(d, codec, size)
    assert len(w.parts) == len(ours) and len(w.digests) == 16 * len(ours)
    assert wire([t.clone() for t in d], codec, size).digests == w.digests  # the codec is deterministic
    for i, (part, info) in enumerate(wire_parts(d, codec, size)):  # what a reducer receives and decodes
        sent = codec.compress(part, info)
        assert part_digest(sent) == w.digests[16 * i : 16 * i + 16]
        assert torch.equal(deserialize(sent).reshape(-1), w.parts[i])
    changed = [t.clone() for t in d]
    changed[0][123] += 1.0
    digests = wire(changed, codec, size).digests
    differ = [i for i in range(len(ours)) if digests[16 * i : 16 * i + 16] != w.digests[16 * i : 16 * i + 16]]
    assert differ == [0]
    assert commitment(w.digests) != commitment(digests)


def test_the_seed_depends_on_every_commitment_and_not_on_their_order():
    assert sketch_seed("run", 3, ["a", "b"]) == sketch_seed("run", 3, ["b", "a"])
    assert sketch_seed("run", 3, ["a", "b"]) != sketch_seed("run", 3, ["a", "c"])
    assert sketch_seed("run", 3, ["a", "b"]) != sketch_seed("run", 4, ["a", "b"])


def test_a_sketch_is_linear_and_estimates_distance_within_a_few_percent():
    a, b = delta(0), delta(1)
    for seed in range(20):
        sa, sb = sketch(a, seed), sketch(b, seed)
        difference = sketch([x - y for x, y in zip(a, b)], seed)
        torch.testing.assert_close(sa - sb, difference, rtol=1e-6, atol=1e-6)
    for relative in (0.003, 0.05, 0.5):
        b = nearby(a, relative)
        errors = [distance(sketch(a, s), sketch(b, s)) / distance(flat(a), flat(b)) - 1 for s in range(50)]
        assert max(abs(e) for e in errors) < 0.15, errors


@pytest.mark.parametrize(
    "other, numeric_class, outcome",
    [
        (lambda d: nearby(d, 0.003), "cpu/float32", Outcome.AGREE),  # float32, another thread count
        (lambda d: nearby(d, 0.055), "cpu/bfloat16", Outcome.AGREE),  # float32 vs bfloat16
        (lambda d: nearby(d, 0.055), "cpu/float32", Outcome.DISSENT),  # that far is not float32 rounding
        (lambda d: delta(7), "cpu/float32", Outcome.DISSENT),  # another shard
        (lambda d: [-10 * t for t in d], "cpu/float32", Outcome.DISSENT),
        (lambda d: [torch.zeros_like(t) for t in d], "cpu/float32", Outcome.DISSENT),
        (lambda d: [t * 1.5 for t in d], "cpu/bfloat16", Outcome.DISSENT),  # lazy, scaled up
    ],
    ids=["fp32", "bf16", "fp32_too_far", "wrong_shard", "sign_flip_x10", "zero", "scaled"],
)
def test_a_pair_of_replicas(other, numeric_class, outcome):
    d = delta(0)
    seed = group_seed("run", 0, ["n1", "n2"])
    verdict = judge([report("a", d, seed), report("b", other(d), seed, numeric_class)])
    assert verdict.outcome == outcome, verdict.distances


def test_no_majority_convicts_and_a_non_finite_report_dissents():
    d = delta(0)
    bad = [-t for t in d]
    # Two colluders with the same wrong pseudo-gradient and one honest peer: the group dissents, nobody wins.
    verdict = judge([report("honest", d, 1), report("x", bad, 1), report("y", bad, 1)])
    assert verdict.outcome == Outcome.DISSENT
    nan = Report("b", "cpu/float32", sketch(d, 1), float("nan"))
    assert judge([report("a", d, 1), nan]).outcome == Outcome.DISSENT


def test_the_referee_convicts_whoever_disagrees_with_it_unless_it_agrees_with_nobody():
    d = delta(0)
    bad = [-t for t in d]
    group = [report("honest", d, 1), report("x", bad, 1), report("y", bad, 1)]
    assert refereed(group, report("referee", nearby(d, 0.001), 1)) == {"x", "y"}
    # A referee that agrees with nobody may be the broken one: nobody is convicted.
    assert refereed(group, report("referee", delta(5), 1)) == set()


def test_the_configured_tolerances_are_the_ones_judged_by():
    """verification.tolerance and mixed_tolerance (and the grace rounds' cap) reach the verdict: a ByClass
    is a mapping of no listed keys, and must not read as "no tolerances given"."""
    a = delta(0)
    b = nearby(a, 0.2)
    seed = group_seed("r", 3, ["n"])
    pair = [report("a", a, seed), report("b", b, seed, "cpu/bfloat16")]
    assert judge(pair, ByClass(0.02, 0.15)).outcome == Outcome.DISSENT
    assert judge(pair, ByClass(0.02, MAX_TOLERANCE)).outcome == Outcome.AGREE  # the grace rounds'
    same = [report("a", a, seed), report("b", nearby(a, 0.03), seed)]
    assert judge(same, ByClass(0.02, 0.15)).outcome == Outcome.DISSENT
    assert judge(same, ByClass(0.05, 0.15)).outcome == Outcome.AGREE


def test_tolerances_are_per_class_pair_and_capped():
    assert tolerance("cpu/float32", "cpu/float32") < tolerance("cpu/float32", "cuda/bfloat16")
    calibrated = {("cpu/float32", "cuda/bfloat16"): 0.08, ("cpu/float32", "cpu/float32"): 5.0}
    assert tolerance("cuda/bfloat16", "cpu/float32", calibrated) == 0.08
    assert tolerance("cpu/float32", "cpu/float32", calibrated) == MAX_TOLERANCE


def members(trusted: int, untrusted: int, numeric_class: str = "cpu/float32") -> list[Member]:
    return [Member(f"t{i}", numeric_class, True) for i in range(trusted)] + [
        Member(f"u{i}", numeric_class, False) for i in range(untrusted)
    ]


def every_peer_once(assignment, roster) -> None:
    placed = [p for group in assignment.groups for p in group]
    assert sorted(placed) == sorted(m.peer for m in roster)


@pytest.mark.parametrize("seed", range(20))
def test_every_untrusted_peer_shares_its_shard_with_a_trusted_one_while_there_are_any(seed):
    roster = members(3, 3)
    out = assign(roster, seed, replicas=2, audit_fraction=0.0)
    every_peer_once(out, roster)
    for group in out.groups:
        if any(p.startswith("u") for p in group):
            assert any(p.startswith("t") for p in group) and len(group) >= 2, out.groups
    assert out.shards == 3


def test_a_swarm_of_strangers_is_all_replicated_and_nobody_is_left_alone():
    for n in range(2, 9):
        roster = members(0, n)
        out = assign(roster, 1, replicas=2, audit_fraction=0.0)
        every_peer_once(out, roster)
        assert all(len(g) >= 2 for g in out.groups), out.groups
        assert out.shards == n // 2


def test_trusted_peers_are_audited_at_the_audit_fraction_and_train_alone_otherwise():
    roster = members(10, 0)
    assert assign(roster, 0, replicas=2, audit_fraction=0.0).shards == 10
    assert all(len(g) == 2 for g in assign(roster, 0, replicas=2, audit_fraction=1.0).groups)
    # The work duplicated (a shard trained twice) is about the audit fraction.
    duplicated = sum(
        sum(len(g) - 1 for g in assign(roster, seed, replicas=2, audit_fraction=0.1).groups)
        for seed in range(300)
    )
    assert 0.05 < duplicated / 3000 < 0.15
    # In a small swarm too: a lone audited peer is paired with one that would have trained alone.
    pair = members(2, 0)
    paired = sum(assign(pair, seed, replicas=2, audit_fraction=0.5).shards == 1 for seed in range(400))
    assert 0.65 < paired / 400 < 0.85  # 1 - 0.5²: whenever either is drawn


def test_partners_are_of_the_same_numeric_class_where_possible():
    roster = [
        Member("t-cpu", "cpu/float32", True),
        Member("t-gpu", "cuda/bfloat16", True),
        Member("u-gpu", "cuda/bfloat16", False),
        Member("u-cpu", "cpu/float32", False),
    ]
    for seed in range(10):
        out = assign(roster, seed, replicas=2, audit_fraction=0.0)
        assert set(out.groups) == {("t-gpu", "u-gpu"), ("t-cpu", "u-cpu")}


def test_the_assignment_is_a_function_of_the_roster_and_the_seed_only():
    roster = members(4, 5)
    a = assign(roster, 7, replicas=3, audit_fraction=0.5)
    assert a == assign(list(reversed(roster)), 7, replicas=3, audit_fraction=0.5)
    assert any(assign(roster, s, replicas=3, audit_fraction=0.5) != a for s in range(8, 20))
    assert assign(roster, 7, replicas=1, audit_fraction=0.5).shards == 9
    assert a.shard_of("u0") is not None and a.shard_of("nobody") is None
    with pytest.raises(ValueError, match="audit_fraction"):
        assign(roster, 7, replicas=2, audit_fraction=1.5)


def test_trust_comes_from_agreement_and_bans_from_repeated_convictions():
    rep = Reputation(rounds_to_trust=3, strikes_to_ban=2, window=10)
    for _ in range(3):
        rep.agree(["a", "b"])
    assert rep.trusted("a") and not rep.trusted("new")
    assert rep.convict(["a"], round=5) == set()
    assert not rep.trusted("a")  # one strike costs the trust earned
    assert rep.convict(["a"], round=20) == set()  # the first strike is out of the window by now
    assert rep.convict(["a"], round=25) == {"a"}
    assert "a" in rep.banned and not rep.trusted("a")
    rep.agree(["a"] * 10)
    assert not rep.trusted("a")  # banned for the rest of the run


def test_a_calibrated_tolerance_follows_honest_agreement_between_its_floor_and_the_cap():
    assert calibrate([], floor=0.02) == 0.02
    assert calibrate([0.0, 0.0], floor=0.02) == 0.02  # replicas that agreed exactly do not make it zero
    assert calibrate([0.05, 0.1], floor=0.02) == pytest.approx(0.15)
    assert calibrate([0.2, 5.0], floor=0.02) == MAX_TOLERANCE  # a liar inside the window gains little


# ------------------------------------------------------------------------------- a verifiable round


def claim(
    peer: str,
    group: tuple[str, ...],
    work,
    *,
    shard: str = "0/2",
    nonce: str = "ab",
    cls="cpu/float32",
    roster=(),
):
    """A peer's honest claim: sealed, revealed, sketched under its group's seed."""
    w = wire(work, NoCompression())
    digest = commitment(w.digests)
    seed = group_seed("r", 3, ["ab"] * len(group))
    sketched = sketch(w.parts, seed)
    return Claim(
        peer,
        cls,
        shard,
        group,
        sealed(digest, nonce),
        digest,
        nonce,
        sketched,
        parts=w.digests,
        roster=as_roster(roster),
    )


def as_roster(members):
    """A claim's roster from peer ids (of class cpu/float32) or from (peer, class) pairs."""
    return tuple(sorted((m, "cpu/float32") if isinstance(m, str) else tuple(m) for m in members))


def verdict_of(claims, trusted=(), banned=()):
    return judge_round(
        claims,
        run_id="r",
        round=3,
        trusted=lambda p: p in trusted,
        banned=lambda p: p in banned,
        tolerances=ByClass(0.02, 0.15),
    )


def test_agreeing_replicas_count_once_per_shard_and_a_dissenting_group_is_left_out_whole():
    honest, other = delta(1), delta(2)
    claims = [
        claim("a", ("a", "b"), honest),
        claim("b", ("a", "b"), nearby(honest, 0.001)),
        claim("c", ("c", "x"), other, shard="1/2"),
        claim("x", ("c", "x"), [-10 * t for t in other], shard="1/2"),
    ]
    v = verdict_of(claims)
    assert v.shares == {"a": 0.5, "b": 0.5}
    assert v.left_out == {"c": Why.DISSENT, "x": Why.DISSENT}
    assert v.agreed == (("a", "b"),) and v.dissent == (("c", "x"),)
    assert v.distances[("a", "b")] < 0.02 < v.distances[("c", "x")]


def test_claims_that_do_not_match_count_only_for_trusted_peers():
    work = delta(1)
    claims = [
        claim("a", ("a",), work),  # trained alone
        claim("b", ("b", "c"), work),  # its partner claims another group
        claim("c", ("c", "d"), work),
        claim("e", ("e", "f"), work),  # its partner never showed up
    ]
    v = verdict_of(claims, trusted={"a", "e"})
    assert v.shares == {"a": 1.0, "e": 1.0}
    assert v.left_out == {"b": Why.UNMATCHED, "c": Why.UNMATCHED}
    # The same claims with nobody trusted: nobody counts.
    assert verdict_of(claims).shares == {}


def test_a_reveal_that_does_not_open_its_seal_leaves_its_group_out():
    work = delta(1)
    good = claim("a", ("a", "b"), work)
    bad = claim("b", ("a", "b"), work)
    reground = Claim(
        bad.peer,
        bad.numeric_class,
        bad.shard,
        bad.replicas,
        bad.seal,
        bad.digest,
        "cd",
        bad.sketch,
        bad.parts,
    )
    v = verdict_of([good, reground])
    assert v.left_out == {"a": Why.UNREVEALED, "b": Why.UNREVEALED} and not v.shares
    unsketched = Claim(
        "b", "cpu/float32", "0/2", ("a", "b"), bad.seal, bad.digest, bad.nonce, None, bad.parts
    )
    assert verdict_of([good, unsketched]).left_out["a"] == Why.UNREVEALED
    # Parts' digests that are not the sealed ones do not open the seal either, even for a trusted peer alone.
    other_parts = wire([-t for t in work], NoCompression()).digests
    swapped = Claim(
        "b", "cpu/float32", "0/2", ("a", "b"), bad.seal, bad.digest, bad.nonce, bad.sketch, other_parts
    )
    assert verdict_of([good, swapped]).left_out["b"] == Why.UNREVEALED
    lone = claim("c", ("c",), work)
    lone_swapped = Claim(
        "c",
        lone.numeric_class,
        lone.shard,
        ("c",),
        lone.seal,
        lone.digest,
        lone.nonce,
        lone.sketch,
        other_parts,
    )
    assert verdict_of([lone], trusted={"c"}).shares == {"c": 1.0}
    assert verdict_of([lone_swapped], trusted={"c"}).left_out == {"c": Why.UNREVEALED}


def test_a_banned_peer_counts_for_nothing_and_takes_its_group_down():
    work = delta(1)
    v = verdict_of([claim("a", ("a", "x"), work), claim("x", ("a", "x"), work)], banned={"x"})
    assert v.left_out == {"a": Why.DISSENT, "x": Why.BANNED}


def test_the_assignment_seed_and_a_groups_sketch_seed_are_nobodys_choice():
    assert assignment_seed("r", 3, "aa") != assignment_seed("r", 3, "ab") != assignment_seed("r", 4, "aa")
    assert group_seed("r", 3, ["n1", "n2"]) == group_seed("r", 3, ["n2", "n1"])
    assert group_seed("r", 3, ["n1", "n2"]) != group_seed("r", 3, ["n1", "n3"])
    assert sealed("d", "n1") != sealed("d", "n2") and sealed("d", "n1") != sealed("e", "n1")


def test_a_reputation_survives_a_round_trip_and_a_malformed_one_is_ignored_whole():
    rep = Reputation(rounds_to_trust=1)
    rep.agree(["a"])
    rep.convict(["x"], round=3)
    again = Reputation(rounds_to_trust=1)
    again.restore(rep.to_dict())
    assert again.to_dict() == rep.to_dict() and again.trusted("a")
    too_many = {"agreed": {}, "strikes": {"x": list(range(64)) + ["no"]}, "banned": []}
    for bad in (
        None,
        [],
        {"agreed": {"a": -1}, "strikes": {}, "banned": []},
        {"agreed": {}, "strikes": {}},
        too_many,
    ):
        fresh = Reputation()
        fresh.restore(bad)
        assert fresh.to_dict() == Reputation().to_dict()


def test_a_reputations_digest_covers_the_counts_that_its_lists_leave_out():
    rep = Reputation(rounds_to_trust=3)
    rep.agree(["a", "b"])
    again = Reputation(rounds_to_trust=3)
    again.restore(rep.to_dict())
    assert Reputation.digest_of(again.to_dict()) == Reputation.digest_of(rep.to_dict())
    ahead = Reputation(rounds_to_trust=3)
    ahead.restore({**rep.to_dict(), "agreed": {"a": 2, "b": 1}})
    assert ahead.listed(8) == rep.listed(8), "nobody trusted either way: the lists cannot tell them apart"
    assert Reputation.digest_of(ahead.to_dict()) != Reputation.digest_of(rep.to_dict())
    assert rec("a", 0).copy(update={"reputation": Reputation.digest_of(rep.to_dict())}).reputation


def test_a_sketch_survives_the_record():
    work = delta(1)
    s = sketch(work, 7)
    record = rec("a", 3, state="averaging").copy(
        update={"shard": "0/2", "replicas": ["a", "b"], "sketch": s.float().numpy().tobytes()}
    )
    parsed = Claim.of(ProgressRecord.parse_obj(record.wire()))
    assert parsed.replicas == ("a", "b") and distance(parsed.sketch, s) < 1e-6
    too_short = Claim.of(record.copy(update={"sketch": b"\0" * 8}))
    assert too_short.sketch is None


def test_a_dissent_goes_to_a_referee_that_everyone_names_alike_and_that_is_not_in_the_group():
    honest, other = delta(1), delta(2)
    claims = [
        claim("a", ("a", "b"), honest),
        claim("b", ("a", "b"), honest),
        claim("c", ("c", "x"), other, shard="1/2"),
        claim("x", ("c", "x"), [-10 * t for t in other], shard="1/2"),
    ]
    v = verdict_of(claims)
    (dispute,) = disputes(v, claims, run_id="r", round=3, trusted=lambda p: False)
    assert dispute.group == ("c", "x") and dispute.shard == "1/2" and dispute.referee in {"a", "b"}
    assert dispute.seed == group_seed("r", 3, ["ab", "ab"])
    # Trusted peers referee first; the draw depends on nobody's choice but the round and the group.
    assert referee_for(("c", "x"), ["a", "b"], run_id="r", round=3, trusted=lambda p: p == "b") == "b"
    assert referee_for(("c", "x"), ["c", "x"], run_id="r", round=3, trusted=lambda p: True) is None
    # The referee's recomputation convicts the one that sent flipped work, not its honest partner.
    referee = Report("a", "cpu/float32", sketch(nearby(other, 0.001), dispute.seed), 1.0)
    assert refereed(dispute.reports, referee, ByClass(0.02, 0.15)) == {"x"}
    # A group that a banned member took down needs no referee.
    banned = verdict_of(claims, banned={"x"})
    assert disputes(banned, claims, run_id="r", round=3, trusted=lambda p: False) == []


def test_a_pending_dispute_travels_with_the_reputation_its_digest_covers_and_a_malformed_one_not_at_all():
    other = delta(2)
    claims = [
        claim("a", ("a", "b"), delta(1)),
        claim("b", ("a", "b"), delta(1)),
        claim("c", ("c", "x"), other, shard="1/2"),
        claim("x", ("c", "x"), [-10 * t for t in other], shard="1/2"),
    ]
    found = disputes(verdict_of(claims), claims, run_id="r", round=3, trusted=lambda p: False)
    rep = Reputation()
    rep.agree(["a", "b"])
    saved = donated(rep, found)
    assert donated(rep, []) == rep.to_dict(), "without disputes, the reputation (and its digest) as before"
    assert Reputation.digest_of(saved) != Reputation.digest_of(rep.to_dict())
    (back,) = Dispute.pending_of(json.loads(json.dumps(saved)))  # as it travels: JSON
    assert (back.round, back.group, back.shard, back.seed, back.referee) == (
        3,
        ("c", "x"),
        "1/2",
        found[0].seed,
        found[0].referee,
    )
    assert [r.peer for r in back.reports] == ["c", "x"]
    assert all(
        torch.equal(r.sketch, f.sketch.float().double()) for r, f in zip(back.reports, found[0].reports)
    )
    assert Reputation.digest_of(donated(rep, [back])) == Reputation.digest_of(saved), "the same digest again"
    wrong = json.loads(json.dumps(saved))
    wrong["disputes"][0]["reports"][0]["sketch"] = "zz" * 4 * SKETCH_WIDTH
    spaced = json.loads(json.dumps(saved))  # bytes.fromhex skips spaces: 1 byte, not a sketch
    spaced["disputes"][0]["reports"][0]["sketch"] = "00" + " " * (8 * SKETCH_WIDTH - 2)
    upper = json.loads(json.dumps(saved))  # the same bytes, another digest: refused
    upper["disputes"][0]["reports"][0]["sketch"] = "AB" * 4 * SKETCH_WIDTH
    long_id = json.loads(json.dumps(saved))
    long_id["disputes"][0]["referee"] = "Qm" * 1000
    short = json.loads(json.dumps(saved))
    short["disputes"][0]["reports"].pop()
    too_many = {"disputes": saved["disputes"] * (Dispute.MAX_PER_ROUND + 1)}
    assert len(Dispute.pending_of({"disputes": saved["disputes"] * Dispute.MAX_PER_ROUND})) == 16
    for bad in (
        wrong,
        spaced,
        upper,
        long_id,
        short,
        {"disputes": "all"},
        {"disputes": [{}]},
        too_many,
        None,
    ):
        assert Dispute.pending_of(bad) == [], bad


def test_at_most_sixteen_disputes_of_a_round_are_settled_the_same_ones_on_every_peer():
    """What travels with a donated state is bounded (MAX_DONATED_DISPUTE_BYTES): every peer keeps the first
    MAX_PER_ROUND of the verdict's dissenting groups, so their digests stay alike."""
    honest, other = delta(1, 2000), delta(2, 2000)
    claims = [claim("a", ("a", "b"), honest, shard="0/18"), claim("b", ("a", "b"), honest, shard="0/18")]
    for i in range(1, 18):
        group = (f"c{i:02d}", f"x{i:02d}")
        claims.append(claim(group[0], group, other, shard=f"{i}/18"))
        claims.append(claim(group[1], group, [-10 * t for t in other], shard=f"{i}/18"))
    v = verdict_of(claims)
    assert len(v.dissent) == 17
    found = disputes(v, claims, run_id="r", round=3, trusted=lambda p: False)
    assert [d.group for d in found] == [tuple(g) for g in v.dissent[: Dispute.MAX_PER_ROUND]]
    assert len(json.dumps(donated(Reputation(), found))) < MAX_DONATED_DISPUTE_BYTES


def test_a_claimed_shard_is_read_only_if_it_exists():
    assert parse_shard("1/2", 10) == (1, 2)
    for bad in ("2/2", "1/11", "-1/2", "1/", "a/b", "", "1/2/3", "\u00b2/3", "1/2\n"):
        assert parse_shard(bad, 10) is None, bad


def test_three_replicas_and_a_lone_peer_fit_a_record():
    """assign may add one lone peer to a group: with verification.replicas 3, groups of 4."""
    members = [Member(f"p{i}", "cpu/float32", False) for i in range(4)]
    plan = assign(members, 1, replicas=3, audit_fraction=0.0)
    assert max(len(g) for g in plan.groups) == 4
    group = list(plan.groups[0])
    record = rec("a", 1).copy(update={"replicas": group, "ref_group": group})
    assert ProgressRecord.parse_obj(record.wire()).replicas == list(plan.groups[0])


def test_each_part_owns_buckets_in_proportion_to_its_size():
    layout = sketch_layout([1000, 10, 5000, 1, 4000], 64)
    assert [o for o, _ in layout] == [sum(c for _, c in layout[:i]) for i in range(5)]
    assert sum(c for _, c in layout) == 64 and min(c for _, c in layout) == 1
    assert layout[2][1] > layout[4][1] > layout[0][1] > layout[1][1]
    with pytest.raises(ValueError, match="3 parts"):
        sketch_layout([1, 1, 1], 2)


def test_a_reducer_checks_a_part_alone_and_catches_other_bytes_and_a_copied_sketch():
    codec = make_codec("int8", small_tensor_numel=64)
    honest = wire([*delta(1, size=300_000), torch.randn(40)], codec)
    layout = sketch_layout([p.numel() for p in honest.parts])
    s = sketch(honest.parts, 11)
    for i, part in enumerate(honest.parts):  # a part's buckets need that part only
        offset, count = layout[i]
        assert torch.equal(part_sketch(part, 11, i, count), s[offset : offset + count])
    mine = Sealed(honest.digests, s.float().numpy().tobytes(), 11)
    for i, part in enumerate(honest.parts):
        digest = honest.digests[16 * i : 16 * i + 16]
        assert sent_problem(mine, i, digest, part, layout) is None
    # Bytes other than the sealed ones (the sender knew the seed by then: only the digest can tell).
    flipped = wire([*[-10 * t for t in delta(1, size=300_000)], torch.randn(40)], codec)
    assert (
        sent_problem(mine, 0, flipped.digests[:16], flipped.parts[0], layout)
        == "part 0 is not the one it sealed"
    )
    # Sealed flipped bytes, but published its partner's (honest) sketch: each part's buckets tell.
    copied = Sealed(flipped.digests, s.float().numpy().tobytes(), 11)
    for i in range(len(flipped.parts)):
        problem = sent_problem(copied, i, flipped.digests[16 * i : 16 * i + 16], flipped.parts[i], layout)
        assert problem == f"its sketch is not of part {i} as sent" or i == len(flipped.parts) - 1  # same tail
    # Without a sketch (a trusted peer whose partner vanished), the digests are still checked.
    assert sent_problem(Sealed(honest.digests), 0, honest.digests[:16], honest.parts[0], layout) is None


def test_reducers_learn_each_counted_peers_seal_and_its_groups_seed():
    work = delta(1)
    claims = [
        claim("a", ("a", "b"), work),
        claim("b", ("a", "b"), work),
        claim("c", ("c",), work, nonce="ab"),
    ]
    v = verdict_of(claims, trusted={"c"})
    table = sealed_parts(v, claims, run_id="r", round=3)
    assert set(table) == {"a", "b", "c"}
    assert table["a"].seed == group_seed("r", 3, ["ab", "ab"]) and table["a"].digests == claims[0].parts
    assert table["c"].seed == group_seed("r", 3, ["ab"])
    assert table["a"].sketch == claims[0].sketch.float().numpy().tobytes()


def planner(trusted=(), audit_fraction=0.0):
    """The round's assignment over a roster, as the trainer's ``_plan`` computes it."""
    return lambda roster: assign(
        [Member(p, c, p in trusted) for p, c in as_roster(roster)],
        5,
        replicas=2,
        audit_fraction=audit_fraction,
    )


def claims_as_assigned(plan, roster, work, **changes):
    """Every roster member's honest claim of the group and shard the plan gives it (``changes``: peer ->
    (group, shard) claimed instead)."""
    out = []
    for i, group in enumerate(plan.groups):
        for p in group:
            g, shard = changes.get(p, (group, f"{i}/{plan.shards}"))
            out.append(claim(p, g, work, shard=shard, roster=roster))
    return out


def test_colluders_cannot_choose_each_other_as_replicas():
    roster = ("a", "b", "x", "y")
    plan = planner()(roster)
    work = delta(1)
    honest = verdict_of(claims_as_assigned(plan, roster, work), trusted=())
    assert set(honest.shares) == set(roster)
    judged = judge_round(
        claims_as_assigned(plan, roster, work), run_id="r", round=3, trusted=lambda p: False, plan=planner()
    )
    assert set(judged.shares) == set(roster), judged.left_out  # claims as assigned count
    if plan.shard_of("x") == plan.shard_of("y"):  # the seed paired them anyway: nothing to claim
        return
    # x and y claim each other, on x's shard: both are left out, whatever their sketches.
    x_shard = f"{plan.shard_of('x')}/{plan.shards}"
    lying = claims_as_assigned(plan, roster, work, x=(("x", "y"), x_shard), y=(("x", "y"), x_shard))
    v = judge_round(lying, run_id="r", round=3, trusted=lambda p: False, plan=planner())
    assert v.left_out["x"] == v.left_out["y"] == Why.MISASSIGNED
    assert "x" not in v.shares and "y" not in v.shares


def test_a_trusted_peer_drawn_for_an_audit_cannot_claim_to_have_trained_alone():
    roster, trusted = ("a", "b"), {"a", "b"}
    seed_plan = planner(trusted, audit_fraction=1.0)
    plan = seed_plan(roster)
    assert plan.groups == (("a", "b"),)
    work = delta(1)
    dodge = claims_as_assigned(plan, roster, work, b=(("b",), "0/1"))
    v = judge_round(dodge, run_id="r", round=3, trusted=trusted.__contains__, plan=seed_plan)
    assert v.left_out["b"] == Why.MISASSIGNED and v.shares == {"a": 1.0}  # a's partner dodged: a counts alone
    # Its partner left before claiming anything: the one that stayed counts alone.
    alone = [c for c in claims_as_assigned(plan, roster, work) if c.peer == "a"]
    assert judge_round(alone, run_id="r", round=3, trusted=trusted.__contains__, plan=seed_plan).shares == {
        "a": 1.0
    }


def test_the_roster_is_the_one_trusted_claimants_name_and_new_identities_cannot_outvote_them():
    roster, trusted = ("a", "b", "c", "d"), {"a", "b"}
    plan = planner(trusted)(roster)
    work = delta(1)
    claims = claims_as_assigned(plan, roster, work)
    # Three sybils name a roster of their own (in which they pair up): they are many, but not trusted.
    fake = ("s1", "s2", "s3")
    fake_plan = planner(trusted)(fake)
    claims += claims_as_assigned(fake_plan, fake, work)
    v = judge_round(claims, run_id="r", round=3, trusted=trusted.__contains__, plan=planner(trusted))
    assert {"a", "b", "c", "d"} <= set(v.shares)
    assert all(v.left_out[s] == Why.MISASSIGNED for s in fake), v.left_out


def test_replicas_are_judged_by_the_classes_the_roster_vote_gives_them_not_by_their_claims():
    """A claim's numeric class is what its peer's record says when the verdict reads it, which the peer can
    change between two honest peers' reads; the roster's vote fixes each member's class for the round (the
    plan's pairing, the verdict's tolerances and a dispute's reports alike)."""
    work = delta(0)
    near = nearby(work, 0.1)  # within the mixed tolerance (0.15), beyond the same-class one (0.02)
    peers, x = ["a", "b", "c", "d"], "b"

    def judged(roster, x_claims):
        plan = planner()(roster)
        claims = [
            claim(
                p,
                group,
                near if p == x else work,
                shard=f"{i}/{plan.shards}",
                cls=x_claims if p == x else "cpu/float32",
                roster=roster,
            )
            for i, group in enumerate(plan.groups)
            for p in group
        ]
        v = judge_round(claims, run_id="r", round=3, trusted=lambda p: False, plan=planner())
        return claims, v, next(g for g in plan.groups if x in g)

    # x's record says bfloat16 by the time the verdict reads it, but the roster says float32: dissent.
    claims, v, group = judged(as_roster(peers), "cuda/bfloat16")
    assert v.dissent == (group,) and v.classes[x] == "cpu/float32", v
    # The dispute carries the classes the group was judged as: the referee is compared with those.
    (d,) = disputes(v, claims, run_id="r", round=3, trusted=lambda p: False)
    assert [r.numeric_class for r in d.reports] == ["cpu/float32", "cpu/float32"]
    assert d.referee_class == "cpu/float32"
    assert [x.to_dict() for x in Dispute.pending_of(donated(Reputation(), [d]))] == [d.to_dict()]
    # And so is the referee's report, whatever class its record states when a peer settles the dispute.
    import types

    from p2ptrain.trainer import Trainer

    sketch = d.reports[0].sketch.float().numpy().tobytes()
    ref = rec(d.referee, 4).copy(
        update={
            "numeric_class": "cuda/bfloat16",
            "ref_round": 3,
            "ref_group": list(d.group),
            "ref_sketch": sketch,
        }
    )
    me = types.SimpleNamespace(peer_id="someone else", numeric_class="cpu/float32")
    report = Trainer._referee_report(me, d, {d.referee: ref})
    assert report is not None and report.numeric_class == "cpu/float32"
    # And the other way: a roster that names x bfloat16 compares it as such, whatever its record says now.
    claims, v, group = judged(
        as_roster([(x, "cuda/bfloat16") if p == x else p for p in peers]), "cpu/float32"
    )
    assert group in v.agreed and not v.dissent, v


def test_a_drifted_reputation_takes_the_one_most_trusted_peers_carry_and_only_that():
    # Three trusted peers carry D, we carry E (we read a round's claims otherwise): we take D.
    assert swarm_reputation("E", ["D", "D", "D"], trusted_self=True) == "D"
    assert swarm_reputation("", ["D", "D"], trusted_self=False) == "D"  # ours was never backed
    # We are the majority, or nobody is: nobody moves (an even split is not for one side to settle).
    assert swarm_reputation("D", ["D", "E"], trusted_self=True) is None
    assert swarm_reputation("E", ["D", "D", "E", "E"], trusted_self=False) is None
    assert swarm_reputation("E", ["D", "D", "F"], trusted_self=True) is None  # 2 of 4
    # One trusted peer alone never hands anyone a reputation, however few the others.
    assert swarm_reputation("E", ["D"], trusted_self=False) is None
    assert swarm_reputation("", ["D"], trusted_self=True) is None
    # A trusted peer that carries no digest counts against every digest: one of three is no majority.
    assert swarm_reputation("E", ["", "", "D"], trusted_self=False) is None
    assert swarm_reputation("E", ["", "D", "D"], trusted_self=False) == "D"
    assert swarm_reputation("E", [], trusted_self=True) is None
