"""Verification by replicas, the pure parts: commitments, sketches, verdicts, referees."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.verify import (
    MAX_TOLERANCE,
    Member,
    Outcome,
    Report,
    Reputation,
    assign,
    calibrate,
    commitment,
    distance,
    judge,
    refereed,
    sketch,
    sketch_seed,
    tolerance,
)


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


def report(peer: str, tensors, seed: int, numeric_class: str = "cpu/float32") -> Report:
    return Report(peer, numeric_class, sketch(tensors, seed), float(flat(tensors).norm()))


def test_a_commitment_changes_with_any_value_and_shape():
    d = delta(0)
    assert commitment(d) == commitment([t.clone() for t in d])
    changed = [t.clone() for t in d]
    changed[0][123] += 1e-6
    assert commitment(changed) != commitment(d)
    assert commitment([d[0], d[1].reshape(3, 7)]) != commitment(d)


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
    seed = sketch_seed("run", 0, [commitment(d), commitment(other(d))])
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
    audited = sum(
        sum(len(g) for g in assign(roster, seed, replicas=2, audit_fraction=0.1).groups if len(g) > 1)
        for seed in range(300)
    )
    assert 0.05 < audited / 3000 < 0.15


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
