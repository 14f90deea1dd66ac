"""The outer step against hand-computed numbers, through a fake averager (no network)."""

import math

import pytest
import torch
import torch.nn as nn

from p2ptrain.diloco import AverageResult, AveragingFailed, DiLoCo, tensors_hash


class FakeAverager:
    """Averages our tensors with fixed contributions of imaginary groupmates, weighted by samples."""

    def __init__(
        self,
        others: list[tuple[list[torch.Tensor], float]] | None = None,
        fail: str | None = None,
        failures: int = 0,
    ):
        self.others = others or []
        self.fail = fail
        self.failures = failures  # calls that fail ("no_group") before one succeeds
        self.calls = []

    def average(self, tensors, *, weight, round, attempts=None):
        self.calls.append((round, weight, attempts))
        if self.fail:
            raise AveragingFailed(self.fail)
        if self.failures:
            self.failures -= 1
            raise AveragingFailed("no_group")
        total = weight + sum(w for _, w in self.others)
        avg = [t * weight for t in tensors]
        for ts, w in self.others:
            avg = [a + o * w for a, o in zip(avg, ts)]
        return AverageResult(tensors=[a / total for a in avg], group_size=1 + len(self.others))


def scalar_model(value: float) -> nn.Module:
    m = nn.Module()
    m.w = nn.Parameter(torch.tensor([value]))
    return m


def test_pseudo_gradient_is_old_minus_new():
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True)
    with torch.no_grad():
        model.w.fill_(0.8)
    assert torch.allclose(d.pseudo_gradient()[0], torch.tensor([0.2]))


def test_two_rounds_match_hand_computed_nesterov():
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True)

    # Round 0: our delta 0.2 (weight 1), a groupmate's 0.4 (weight 3) -> average 0.35.
    with torch.no_grad():
        model.w.fill_(0.8)
    report = d.sync(FakeAverager([([torch.tensor([0.4])], 3.0)]), weight=1.0, round=0)
    # buf = 0.35; nesterov update = g + mu * buf = 0.35 + 0.315 = 0.665; w = 1 - 0.7 * 0.665 = 0.5345
    assert report.group_size == 2 and report.failure is None
    assert math.isclose(d.master[0].item(), 0.5345, rel_tol=1e-6)
    assert math.isclose(model.w.item(), 0.5345, rel_tol=1e-6)  # the model restarts from the new globals
    assert d.round == 1

    # Round 1: our delta 0.1 (weight 1), groupmate 0.3 (weight 1) -> 0.2.
    with torch.no_grad():
        model.w.fill_(0.5345 - 0.1)
    d.sync(FakeAverager([([torch.tensor([0.3])], 1.0)]), weight=1.0, round=1)
    # buf = 0.9 * 0.35 + 0.2 = 0.515; update = 0.2 + 0.9 * 0.515 = 0.6635; w = 0.5345 - 0.7 * 0.6635 = 0.07005
    assert math.isclose(d.master[0].item(), 0.07005, rel_tol=1e-5)
    assert math.isclose(d.momentum_buffers()[0].item(), 0.515, rel_tol=1e-6)


def test_failed_averaging_falls_back_to_own_delta():
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=1.0, momentum=0.0, nesterov=False)
    with torch.no_grad():
        model.w.fill_(0.75)
    report = d.sync(FakeAverager(fail="no_group"), weight=1.0, round=0)
    assert report.failure == "no_group" and report.group_size == 1
    assert math.isclose(
        d.master[0].item(), 0.75
    )  # plain SGD lr 1 on its own delta: lands on the local params


def test_a_failed_average_is_tried_again_one_attempt_at_a_time_while_again_says_so():
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=1.0, momentum=0.0, nesterov=False)
    with torch.no_grad():
        model.w.fill_(0.75)
    averager = FakeAverager(others=[([torch.tensor([0.0])], 1.0)], failures=2)
    asked = []
    report = d.sync(averager, weight=1.0, round=0, again=lambda: asked.append(1) or True)
    assert report.failure is None and report.group_size == 2 and len(asked) == 2
    # The configured attempts first, then one at a time.
    assert [attempts for _, _, attempts in averager.calls] == [None, 1, 1]
    assert math.isclose(d.master[0].item(), 1.0 - 0.25 / 2)  # the average of 0.25 and 0: not our own step
    # again() says no: no further call, and the fallback steps alone.
    averager = FakeAverager(failures=5)
    report = d.sync(averager, weight=1.0, round=1, again=lambda: False)
    assert report.failure == "no_group" and len(averager.calls) == 1


def test_a_stop_during_averaging_applies_nothing():
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=1.0, momentum=0.0, nesterov=False)
    with torch.no_grad():
        model.w.fill_(0.75)
    report = d.sync(FakeAverager(fail="stopped"), weight=1.0, round=0)
    assert not report.applied and d.master[0].item() == 1.0 and model.w.item() == 1.0 and d.round == 0


def test_failed_averaging_steps_nothing_when_fallback_declines():
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=1.0, momentum=0.0, nesterov=False)
    with torch.no_grad():
        model.w.fill_(0.75)
    report = d.sync(FakeAverager(fail="no_group"), weight=1.0, round=0, fallback=lambda: False)
    assert not report.applied and report.failure == "no_group"
    assert d.master[0].item() == 1.0 and model.w.item() == 1.0 and d.round == 0


def test_alone_applies_own_delta_without_averager():
    model = scalar_model(2.0)
    d = DiLoCo(model, lr=0.5, momentum=0.0, nesterov=False)
    with torch.no_grad():
        model.w.fill_(1.0)
    report = d.sync(None, weight=5, round=0)
    assert report.group_size == 1 and math.isclose(d.master[0].item(), 1.5)


def test_non_finite_delta_is_never_sent_and_state_is_kept():
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True)
    with torch.no_grad():
        model.w.fill_(float("nan"))
    averager = FakeAverager()
    report = d.sync(averager, weight=1.0, round=0)
    assert not report.applied and report.failure == "non_finite"
    assert averager.calls == []
    assert d.master[0].item() == 1.0 and model.w.item() == 1.0 and d.round == 0


def test_state_roundtrip_and_rebase():
    torch.manual_seed(0)
    a = DiLoCo(nn.Linear(3, 2), lr=0.7, momentum=0.9, nesterov=True)
    with torch.no_grad():
        for p in a.model_params:
            p.add_(0.1)
    a.sync(None, weight=1, round=0)
    b = DiLoCo(nn.Linear(3, 2), lr=0.7, momentum=0.9, nesterov=True)
    with torch.no_grad():
        for p in b.model_params:
            p.sub_(0.05)  # b's inner progress
    delta = b.pseudo_gradient()
    b.load_state_tensors(a.state_tensors(), round=a.round)
    assert b.params_hash() == a.params_hash() and b.round == 1
    b.rebase(delta)
    assert all(torch.allclose(x, y) for x, y in zip(b.pseudo_gradient(), delta))


def test_a_rebase_keeps_the_pseudo_gradient_bit_for_bit_until_the_params_change():
    """A verifiable round seals its parts before the barrier, where a peer may rebase: what it sends after
    must be what it sealed, or its reducers refuse it for good (in-memory swarm after a split, 2026-12-08)."""
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    d = DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True)
    with torch.no_grad():
        for p in d.model_params:
            p.add_(torch.randn_like(p) * 1e-3)
    delta = d.pseudo_gradient()
    new_master = [m + torch.randn_like(m) for m in d.master]
    d.load_state_tensors([*new_master, *d.momentum_buffers()], round=d.round)
    recomputed = [m - (m - x) for m, x in zip(d.master, delta)]
    assert not all(torch.equal(a, b) for a, b in zip(recomputed, delta))  # rounding: why it is kept
    d.rebase(delta)
    assert all(torch.equal(a, b) for a, b in zip(d.pseudo_gradient(), delta))
    with torch.no_grad():
        model.weight.add_(1.0)  # an inner step, say: the pseudo-gradient is master - local again
    assert not torch.equal(d.pseudo_gradient()[0], delta[0])
    assert torch.equal(d.pseudo_gradient()[0], d.master[0] - model.weight.detach())


def test_load_state_rejects_mismatched_or_non_finite():
    d = DiLoCo(nn.Linear(3, 2), lr=0.7, momentum=0.9, nesterov=True)
    good = d.state_tensors()
    with pytest.raises(ValueError, match="expected 4"):
        d.load_state_tensors(good[:2], round=1)
    bad = [t.clone() for t in good]
    bad[0][0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        d.load_state_tensors(bad, round=1)
    with pytest.raises(ValueError, match="expected"):
        d.load_state_tensors([torch.zeros(5)] + good[1:], round=1)


def test_tensors_hash_is_exact():
    t = torch.ones(4)
    u = t.clone()
    u[2] = torch.nextafter(u[2], torch.tensor(2.0))
    assert tensors_hash([t]) == tensors_hash([t.clone()]) != tensors_hash([u])


@pytest.mark.parametrize(
    "poison",
    [
        lambda t: [torch.full_like(t[0], float("nan"))],
        lambda t: [torch.full_like(t[0], float("inf"))],
        lambda t: [torch.zeros(3)],  # another shape
        lambda t: [],  # missing tensors
    ],
)
def test_a_poisoned_average_is_refused_never_applied(poison):
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=1.0, momentum=0.0, nesterov=False)
    with torch.no_grad():
        model.w.fill_(0.75)

    class Poisoner:
        def average(self, tensors, *, weight, round, attempts=None):
            return AverageResult(tensors=poison(tensors), group_size=2)

    report = d.sync(Poisoner(), weight=1.0, round=0)
    assert report.failure == "rejected" and report.group_size == 1  # it stepped with its own delta instead
    assert torch.isfinite(d.master[0]).all() and math.isclose(d.master[0].item(), 0.75)
    report = d.sync(Poisoner(), weight=1.0, round=1, fallback=lambda: False)
    assert not report.applied and d.round == 1 and math.isclose(d.master[0].item(), 0.75)


def test_a_verifiable_rounds_lr_ramps_up_over_its_first_steps_and_the_runs_warmup_still_applies():
    from p2ptrain.config import InnerConfig
    from p2ptrain.inner import inner_lr, round_warmup

    assert [round_warmup(s, 5) for s in range(7)] == [0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0]
    assert round_warmup(0, 0) == 1.0  # off
    cfg = InnerConfig(lr=0.01, warmup_steps=20, num_inner_steps=15)
    # Round 1, step 0 (step 15 of the run): the run's warmup (16/20) and the round's ramp (1/5) multiply.
    assert math.isclose(inner_lr(cfg, 15) * round_warmup(0, 5), 0.01 * 16 / 20 / 5)


def test_the_device_benchmark_leaves_the_model_and_the_random_numbers_alone():
    from p2ptrain.config import InnerConfig
    from p2ptrain.inner import benchmark_device
    from p2ptrain.models import build_model

    model = build_model("gpt-nano", 16, dropout=0.1, seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    tokens = torch.randint(256, (4, 17), generator=torch.Generator().manual_seed(0))
    batch = tokens[:, :-1], tokens[:, 1:]
    samples_per_s, flops = benchmark_device(model, InnerConfig(batch_size=4), batch=batch, steps=2)
    assert torch.equal(torch.rand(3), expected), "training's random numbers must not shift"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert samples_per_s > 0 and flops == pytest.approx(6 * params * samples_per_s * 16)


def test_models_built_while_another_thread_benchmarks_its_device_get_the_same_weights():
    """Peers of an in-process swarm build their models while another peer times its device: the benchmark's
    fork_rng sets torch's global generator back as it ends, and once did so in the middle of a build (that
    peer started from other weights and rebased at round 0). Before the fix 6 of 1000 builds here differed."""
    import threading

    from p2ptrain.config import InnerConfig
    from p2ptrain.inner import benchmark_device
    from p2ptrain.models import build_model

    reference = build_model("gpt-nano", 16, seed=0)
    tokens = torch.randint(256, (4, 17), generator=torch.Generator().manual_seed(0))
    stop = threading.Event()

    def benchmark_until_stopped():
        while not stop.is_set():
            benchmark_device(
                reference, InnerConfig(batch_size=4), batch=(tokens[:, :-1], tokens[:, 1:]), steps=1
            )

    timer = threading.Thread(target=benchmark_until_stopped)
    timer.start()
    try:
        differing = sum(
            not all(
                torch.equal(a, b)
                for a, b in zip(reference.parameters(), build_model("gpt-nano", 16, seed=0).parameters())
            )
            for _ in range(500)
        )
    finally:
        stop.set()
        timer.join()
    assert differing == 0


def test_replicas_do_what_their_slowest_benchmark_fits_in_a_round_by_time():
    from p2ptrain.config import InnerConfig
    from p2ptrain.inner import replica_steps

    by_time = InnerConfig(round_seconds=10, num_inner_steps=1000, batch_size=16)
    assert replica_steps(by_time, [320.0, 64.0]) == 40  # 10 s x 64 samples/s / 16
    assert replica_steps(by_time, [1e9, 1e9]) == 1000, "at most H"
    assert replica_steps(by_time, [320.0, 0.0]) == 1, "no benchmark published: the slowest there is"
    assert replica_steps(InnerConfig(num_inner_steps=15), [1.0, 1e9]) == 15, "rounds by steps: H"


def test_a_detached_sync_carries_the_next_rounds_progress_over_onto_the_new_params():
    """outer.overlap: the round's pseudo-gradient is frozen, the model trains on, the step lands later."""
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=1.0, momentum=0.0, nesterov=False)
    with torch.no_grad():
        model.w.fill_(0.8)  # round 0's inner phase: delta 0.2
    d.detach()
    with torch.no_grad():
        model.w.sub_(0.05)  # round 1 trains on from 0.8 while round 0 is averaged
    report = d.sync(FakeAverager(others=[([torch.tensor([0.4])], 1.0)]), weight=1.0, round=0)
    assert report.applied and d.round == 1
    assert model.w.item() == pytest.approx(0.75)  # the sync never touched the model
    assert d.master[0].item() == pytest.approx(0.7)  # 1.0 - mean(0.2, 0.4)
    assert d.land() is True
    assert model.w.item() == pytest.approx(0.65)  # the new params, minus round 1's progress so far
    assert not d.detached and d.pseudo_gradient()[0].item() == pytest.approx(0.05)


@pytest.mark.parametrize("carry", [0.5, 0.0])
def test_a_detached_sync_keeps_its_share_of_the_progress_made_since(carry):
    """outer.overlap_carry: the steps taken from our own params keep only that share on the new ones."""
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=1.0, momentum=0.0, nesterov=False, carry=carry)
    with torch.no_grad():
        model.w.fill_(0.8)
    d.detach()
    with torch.no_grad():
        model.w.sub_(0.1)  # round 1's progress while round 0 is averaged
    d.sync(FakeAverager(others=[([torch.tensor([0.4])], 1.0)]), weight=1.0, round=0)
    assert d.land() is True
    assert model.w.item() == pytest.approx(0.7 - carry * 0.1)
    assert d.pseudo_gradient()[0].item() == pytest.approx(carry * 0.1)  # what round 1 sends holds that share


@pytest.mark.parametrize("how", ["failed", "non_finite", "loaded"])
def test_a_detached_sync_that_applies_nothing_drops_the_progress_made_since(how):
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=1.0, momentum=0.0, nesterov=False)
    with torch.no_grad():
        model.w.fill_(float("nan") if how == "non_finite" else 0.8)
    d.detach()
    with torch.no_grad():
        model.w.fill_(0.5)
    if how == "loaded":  # the swarm moved on: its state replaces ours, our work is stale
        d.load_state_tensors([torch.tensor([0.3]), torch.tensor([0.0])], round=5)
    else:
        report = d.sync(FakeAverager(fail="allreduce"), weight=1.0, round=0, fallback=lambda: False)
        assert not report.applied
    assert model.w.item() == 0.5  # untouched until it lands
    assert d.land() is False
    assert model.w.item() == pytest.approx(0.3 if how == "loaded" else 1.0)  # back to the master params


def test_a_detached_rebase_keeps_the_frozen_pseudo_gradient():
    """The barrier found the swarm's params differ from ours: adopt them, keep our (frozen) round's work."""
    model = scalar_model(1.0)
    d = DiLoCo(model, lr=1.0, momentum=0.0, nesterov=False)
    with torch.no_grad():
        model.w.fill_(0.8)
    d.detach()
    with torch.no_grad():
        model.w.sub_(0.1)
    frozen = d.pseudo_gradient()
    d.load_state_tensors([torch.tensor([2.0]), torch.tensor([0.0])], round=0)
    d.rebase(frozen)
    d.sync(None, weight=1.0, round=0)  # alone: steps by our own 0.2
    assert d.master[0].item() == pytest.approx(1.8)
    assert d.land() is True
    assert model.w.item() == pytest.approx(1.7)
