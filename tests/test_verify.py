"""Verification by replicas, the pure parts: commitments, sketches, verdicts, referees."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.verify import (
    MAX_TOLERANCE,
    Outcome,
    Report,
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
