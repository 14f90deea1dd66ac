"""Verifiable rounds end to end on an in-memory swarm: replicas of a shard seal, reveal and compare sketches
of their pseudo-gradients, and a replica group that disagrees is left out of the round's average.

The pure parts (sketches, verdicts, assignment, reputation) are tested in test_verify.py.
"""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch

from p2ptrain.records import PeerState
from p2ptrain.trainer import Trainer
from p2ptrain.verify import Why
from tests.memswarm import Injector, MemorySwarm, PeerThread
from tests.test_rounds import assert_swarm_contract, assert_together_again, cut_then_healed, finish, start


@pytest.fixture(autouse=True)
def _stop_peers_left_running():
    yield
    PeerThread.stop_all()


VERIFY = {"replicas": 2, "rounds_to_trust": 100, "reveal_timeout_s": 20.0}


class FlipsItsWork(Trainer):
    """A key holder that trains as told, then commits to (and sends) -10 times its pseudo-gradient."""

    def inner_phase(self):
        stats = super().inner_phase()
        with torch.no_grad():
            for p, m in zip(self.diloco.model_params, self.diloco.master):
                p.copy_(m + 10 * (m - p))  # so that master - local is -10 times the honest one
        return stats


def test_honest_replicas_agree_every_round_and_everyone_counts(tmp_path):
    swarm = MemorySwarm()
    peers = start(swarm, tmp_path, ["a", "b", "c", "d"], verification=VERIFY)
    finish(peers)
    assert_swarm_contract(tmp_path, peers, ["a", "b", "c", "d"])
    for name, p in peers.items():
        rounds = [r for r, _ in p.trainer.verdicts]
        assert rounds == list(range(p.cfg.outer.num_rounds)), (name, rounds)
        for r, verdict in p.trainer.verdicts:
            assert not verdict.left_out, (name, r, verdict.left_out, verdict.distances)
            assert len(verdict.agreed) == 2 and all(len(g) == 2 for g in verdict.agreed), (name, r, verdict)
            assert max(verdict.distances.values()) <= 0.02, verdict.distances
        assert p.trainer.rounds_applied == list(range(p.cfg.outer.num_rounds))


@pytest.mark.parametrize("rounds_to_trust", [100, 2])
def test_a_verifiable_swarm_whose_peers_lost_each_other_comes_back_together(
    tmp_path, monkeypatch, rounds_to_trust
):
    """Cut off, each peer's round is void (its replica never came; untrusted) or stepped alone (trusted, not
    audited). Before 2026-12-08 the untrusted swarm voided every round after the cut and ended with 3 of its 4
    peers stranded: a void round keeps the params, so no peer was lone, and each had marked every other as
    waited out."""
    verification = {**VERIFY, "rounds_to_trust": rounds_to_trust, "reveal_timeout_s": 5.0}
    swarm, peers = cut_then_healed(tmp_path, monkeypatch, verification=verification)
    assert_together_again(swarm, peers)
    for name, p in peers.items():
        last = [v for r, v in p.trainer.verdicts if r == 15]
        assert len(last) == 1 and not last[0].left_out, (name, last)


def test_a_peer_that_rebases_in_a_verifiable_round_sends_what_it_sealed(tmp_path):
    """Trusted peers (not audited: no replicas) whose round-4 all-reduce failed each stepped alone, and all
    but one rebase at round 5's barrier, after sealing their parts. Before 2026-12-08 the parts they sent
    then differed from the sealed ones by rounding (DiLoCo.rebase), and their reducers refused them for good.
    """
    injector = Injector()
    injector.fail_allreduce(round=4)
    verification = {**VERIFY, "rounds_to_trust": 2, "audit_fraction": 0.0}
    peers = start(
        MemorySwarm(injector), tmp_path, ["a", "b", "c"], verification=verification, outer={"num_rounds": 7}
    )
    finish(peers)
    assert_swarm_contract(tmp_path, peers, ["a", "b", "c"])
    rebased = [name for name, p in peers.items() if ("rebase", 5) in p.trainer.loads]
    assert len(rebased) == 2, {name: p.trainer.loads for name, p in peers.items()}
    for name, p in peers.items():
        assert not p.trainer.refused, (name, p.trainer.refused)
        assert p.trainer.rounds_applied[-2:] == [5, 6], (name, p.trainer.rounds_applied)


def test_an_image_classifiers_flipped_work_is_left_out_as_a_language_models_is(tmp_path):
    """Verification knows nothing of the model: a CNN's pseudo-gradients are sketched and judged alike."""
    from tests.memswarm import fast_config

    names = ["a", "b", "c", "x"]
    sections = {
        "swarm": {"min_peers": 4},
        "averaging": {"target_group_size": 4},
        "verification": VERIFY,
        "data": {"source": "digits", "val_fraction": 0.1},
        "model": {"name": "cnn-small"},
        "inner": {"num_inner_steps": 10, "lr": 0.003, "batch_size": 32, "warmup_steps": 10},
    }
    swarm = MemorySwarm()
    peers = {
        name: PeerThread(
            swarm, name, fast_config(tmp_path, name, **sections), FlipsItsWork if name == "x" else Trainer
        )
        for name in names
    }
    finish(peers)
    x = swarm.peer_id("x")
    for name in ("a", "b", "c"):
        verdicts = peers[name].trainer.verdicts
        judged = [v for _, v in verdicts if x in v.left_out or any(x in g for g in v.agreed)]
        assert judged, f"{name} never judged x"
        assert all(v.left_out.get(x) in (Why.DISSENT, Why.BANNED) for v in judged), verdicts
        assert set(peers[name].trainer.reputation.strikes) == {x}
    assert_swarm_contract(tmp_path, peers, ["a", "b", "c"])


def test_rounds_by_time_replicas_do_what_their_slowest_benchmark_fits_and_still_agree(tmp_path, monkeypatch):
    from p2ptrain import trainer

    speeds = {"a": 400.0, "b": 100.0, "c": 300.0, "d": 200.0}  # samples/s, as if measured at start
    monkeypatch.setattr(trainer, "benchmark_device", lambda model, cfg, **kw: (speeds[_peer_name()], 1e9))
    steps: dict[tuple[str, int], int] = {}
    real_step = trainer.inner_step

    def inner_step(*args, **kwargs):
        key = (_peer_name(), threading.current_thread().round)  # type: ignore[attr-defined]
        steps[key] = steps.get(key, 0) + 1
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "inner_step", inner_step)
    real_phase = trainer.Trainer.inner_phase

    def inner_phase(self):
        threading.current_thread().round = self.round  # type: ignore[attr-defined]
        return real_phase(self)

    monkeypatch.setattr(trainer.Trainer, "inner_phase", inner_phase)
    by_time = {"round_seconds": 0.1, "num_inner_steps": 1000, "batch_size": 4}  # at most 40 samples a round
    swarm = MemorySwarm()
    peers = start(
        swarm,
        tmp_path,
        ["a", "b", "c", "d"],
        verification=VERIFY,
        inner=by_time,
        device={"benchmark_steps": 1},
    )
    finish(peers)
    assert_swarm_contract(tmp_path, peers, ["a", "b", "c", "d"])
    assert peers["a"].trainer.verdicts, "no round was judged: nothing below was checked"
    for r, verdict in peers["a"].trainer.verdicts:
        assert not verdict.left_out and len(verdict.agreed) == 2, (r, verdict)
        for group in verdict.agreed:
            names = [swarm.name_of(p) for p in group]
            expected = int(0.1 * min(speeds[n] for n in names) / 4)  # 2.5 to 10 steps: the slowest's fit
            assert {steps[(n, r)] for n in names} == {expected}, (r, names, steps)
            assert {swarm.weights[(n, r)] for n in names} == {expected * 4 / 2}, "its samples, shared by two"


def _peer_name() -> str:
    return threading.current_thread().name.removeprefix("trainer-")


def test_a_replica_that_commits_to_flipped_work_is_left_out_with_its_group(tmp_path):
    swarm = MemorySwarm()
    names = ["a", "b", "c", "x"]
    peers = {
        name: PeerThread(swarm, name, cfg, FlipsItsWork if name == "x" else Trainer)
        for name, cfg in _configs(tmp_path, names).items()
    }
    finish(peers)
    x = swarm.peer_id("x")
    for name in ("a", "b", "c"):
        verdicts = peers[name].trainer.verdicts
        judged = [v for _, v in verdicts if x in v.left_out or any(x in g for g in v.agreed)]
        assert judged, f"{name} never judged x"
        for verdict in judged:
            assert verdict.left_out.get(x) in (Why.DISSENT, Why.BANNED), verdict
            assert all(x not in g for g in verdict.agreed)
        # A referee recomputed the dissenting shard: x is struck for each attacked round, and banned at the
        # second strike (verification.strikes_to_ban); nobody else is ever struck.
        reputation = peers[name].trainer.reputation
        assert set(reputation.strikes) == {x}, reputation.strikes
        assert reputation.banned == {x}
        # Within 3 attacked rounds (the bound): the second strike lands with a referee's
        # recomputation, which on a busy machine (CI) comes a round later than on an idle one.
        first_judged = next(r for r, v in verdicts if x in v.left_out or any(x in g for g in v.agreed))
        banned_in = next(r for r, v in verdicts if v.left_out.get(x) == Why.BANNED)
        assert banned_in - first_judged <= 3, verdicts
    assert_swarm_contract(tmp_path, peers, ["a", "b", "c"])


class CopiesItsPartnersSketch(FlipsItsWork):
    """Seals (and sends) -10 times its work, and publishes its honest partner's sketch as its own."""

    def _sketch(self, seed):
        mates = [p for p in self._replicas if p != self.peer_id]
        got = self._await_claims(mates, "sketch", self.round, time.monotonic() + 10)
        copied = next((r.sketch for r in got.values() if r.sketch), None)
        if copied is None:
            return super()._sketch(seed)
        return torch.frombuffer(bytearray(copied), dtype=torch.float32)


class ClaimsTwiceItsWeight(Trainer):
    """Honest work, honestly sealed; sends twice the weight its verdict gives it."""

    def verify_round(self, group, stats):
        out = super().verify_round(group, stats)
        if stats.weight is not None:
            stats.weight *= 2
        return out


@pytest.mark.parametrize("attack", ["send_other", "copy_sketch", "claim_weight"])
def test_what_replicas_cannot_see_every_reducer_refuses(tmp_path, attack):
    """Attacks on what a peer says or sends, not on its work: it sends -10 times what it sealed, or it seals
    -10 times its work and copies its partner's sketch, or it claims more weight than the verdict gives it.
    Its replica group agrees (the sketches it compares are honest), but every reducer checks each part
    against its sender's seal and sketch, and each weight against the verdict: the peer's parts never make
    an average, every honest groupmate bans it, and the honest peers end alike."""
    swarm = MemorySwarm()
    names = ["a", "b", "c", "x"]
    cls = {"copy_sketch": CopiesItsPartnersSketch, "claim_weight": ClaimsTwiceItsWeight}.get(attack, Trainer)
    if attack == "send_other":
        swarm.injector.tamper["x"] = lambda delta: -10 * delta
    peers = {
        n: PeerThread(swarm, n, cfg, cls if n == "x" else Trainer)
        for n, cfg in _configs(tmp_path, names).items()
    }
    finish(peers)
    x = swarm.peer_id("x")
    counted = [r for r, v in peers["a"].trainer.verdicts if x in v.shares]
    assert counted, "the replicas were not fooled: this test tests nothing"
    assert swarm.averaged and all(x not in members for _, members in swarm.averaged), swarm.averaged
    for name in ("a", "b", "c"):
        assert x in swarm.caught_by.get(swarm.peer_id(name), set()), name
        assert x in peers[name].trainer.refused, name  # nor waited for, nor read, from then on
        assert not peers[name].trainer.reputation.strikes
    assert_swarm_contract(tmp_path, peers, ["a", "b", "c"])


class ClaimsItsAccomplice(FlipsItsWork):
    """Flips its work, and claims its accomplice (the other peer of this class) as its replica, whatever the
    assignment says: they agree with each other, so without the assignment check they would count."""

    def assignment(self):
        index, count, group = super().assignment()
        others = {pid: r for pid, r in self._visible().items()}
        accomplice = next(p for p in sorted(others) if p.startswith("mem-y") or p.startswith("mem-x"))
        shard = min(index, self._assigned_shard_of(accomplice, count))
        return shard, count, tuple(sorted({self.peer_id, accomplice}))

    def _assigned_shard_of(self, peer, count):
        plan = self._plan(tuple(self._roster_claim()))
        found = plan.shard_of(peer)
        return count if found is None else found


class RemembersPlans(Trainer):
    """An honest peer that keeps each round's assignment (over the roster it named) for the test to read."""

    def verify_round(self, group, stats):
        self.plans = getattr(self, "plans", {})
        self.plans[self.round] = self._plan(tuple(self._roster_claim()))
        return super().verify_round(group, stats)


def test_colluders_that_claim_each_other_against_the_assignment_never_count(tmp_path):
    """Two colluders flip their work and name each other as replicas on the same shard: the verdict holds
    every group to the round's assignment, so they count only where the assignment itself paired them (and
    then their flipped work is the same: replicas cannot tell, as documented)."""
    swarm = MemorySwarm()
    names = ["a", "b", "x", "y"]
    peers = {
        n: PeerThread(swarm, n, cfg, ClaimsItsAccomplice if n in "xy" else RemembersPlans)
        for n, cfg in _configs(tmp_path, names).items()
    }
    finish(peers)
    x, y = swarm.peer_id("x"), swarm.peer_id("y")
    misassigned = 0
    for name in ("a", "b"):
        trainer = peers[name].trainer
        for r, verdict in trainer.verdicts:
            paired = trainer.plans[r].shard_of(x) == trainer.plans[r].shard_of(y)
            if not paired:
                assert x not in verdict.shares and y not in verdict.shares, (r, verdict)
                misassigned += verdict.left_out.get(x) == Why.MISASSIGNED
    assert misassigned, "the assignment never split them: this test tests nothing"
    # Liveness, not learning: the honest peers paired with a liar are unmatched, and those rounds are void
    # (docs/architecture.md#verification). Both honest peers end the run, alike.
    for name in ("a", "b"):
        assert peers[name].result.outcome.value == "final", peers[name].result
    assert peers["a"].trainer.diloco.params_hash() == peers["b"].trainer.diloco.params_hash()


def test_a_class_changed_between_two_peers_reads_gives_them_the_same_verdict(tmp_path):
    """The assignment pairs replicas by numeric class. A key holder that changes its class between two honest
    peers' reads at their assignments (here: peer a reads c and d as bfloat16, the others read float32) must
    not give them different verdicts: the roster's vote fixes every member's class, and peers that read the
    same claims plan alike. a trained in a group of its own view: that costs a its work, nothing more."""
    from p2ptrain import telemetry

    def split_verdicts():
        return telemetry.REGISTRY.get_sample_value("p2ptrain_verification_split_verdicts_total")

    before = split_verdicts()
    swarm = MemorySwarm()
    swarm.injector.misread_class["a"] = {"c": "cpu/bfloat16", "d": "cpu/bfloat16"}
    names = ["a", "b", "c", "d"]
    peers = {n: PeerThread(swarm, n, cfg, RemembersPlans) for n, cfg in _configs(tmp_path, names).items()}
    finish(peers)
    by_round: dict[int, dict[str, str]] = {}
    for name, p in peers.items():
        for r, verdict in p.trainer.verdicts:
            by_round.setdefault(r, {})[name] = verdict.digest()
    assert by_round and all(len(set(d.values())) == 1 for d in by_round.values()), by_round
    assert split_verdicts() == before  # and no peer saw another's verdict differ
    a, b = peers["a"].trainer, peers["b"].trainer
    differed = [r for r in a.plans if r in b.plans and a.plans[r] != b.plans[r]]
    assert differed, "a's misread classes never changed its assignment: this test tests nothing"
    a_id = swarm.peer_id("a")
    for r in differed:  # a trained the group of its own view, which the round's roster does not give it
        verdict = dict(b.verdicts)[r]
        assert verdict.left_out.get(a_id) in (Why.MISASSIGNED, Why.UNMATCHED), (r, verdict)
    assert_swarm_contract(tmp_path, peers, names)


def one_more_round_each(metadata: dict, tensors: list) -> tuple[dict, list]:
    """A donated state as a hostile donor serves it: every peer one round in agreement more than the swarm's."""
    saved = metadata["reputation"]
    metadata["reputation"] = {**saved, "agreed": {p: n + 1 for p, n in saved["agreed"].items()}}
    return metadata, tensors


class CountsOtherwise(Trainer):
    """An honest peer that reads round 1's claims otherwise than the others (as a key holder that shows each
    peer another record can make it): its reputation counts one more agreement for itself from then on, and
    bans ``convicts`` (a hostile referee's report that only this peer read, say). Set per test."""

    convicts = ""
    bans: list = []  # what it banned in round 1
    injector = None
    tamper_realignment = None  # what the first state served to its realignment is, as a hostile donor

    def load_state(self, donors, **kwargs):
        if kwargs.get("why") == "realign" and self.tamper_realignment is not None:
            self.injector.tamper_donation = self.tamper_realignment
            type(self).tamper_realignment = None
        return super().load_state(donors, **kwargs)

    def verify_round(self, group, stats):
        out = super().verify_round(group, stats)
        if self.verdicts[-1][0] == 1:
            self.reputation.agree([self.peer_id])
            self.reputation.convict([self.convicts], 1)
            banned = sorted(self.reputation.convict([self.convicts], 1))
            self.bans.append(banned)
            self.averager.ban(banned)
        return out


def test_a_peer_whose_reputation_drifted_takes_the_one_most_trusted_peers_carry(tmp_path, monkeypatch):
    """d's reputation counts otherwise than the others' after round 1 (and bans a), so its record carries
    another digest into the next round: it downloads that round's state from a trusted peer that carries the
    majority's digest and takes that reputation, and only that one (the first donor serves another, and is
    refused); its averager lifts the ban the swarm does not hold."""
    from p2ptrain import telemetry

    swarm = MemorySwarm()

    def realignments():
        return telemetry.REGISTRY.get_sample_value("p2ptrain_verification_realignments_total")

    before = realignments()
    names = ["a", "b", "c", "d"]
    monkeypatch.setattr(CountsOtherwise, "convicts", "mem-a-0")  # a's id, once it connects
    monkeypatch.setattr(CountsOtherwise, "bans", [])
    monkeypatch.setattr(CountsOtherwise, "injector", swarm.injector)
    monkeypatch.setattr(CountsOtherwise, "tamper_realignment", staticmethod(one_more_round_each))
    peers = {
        n: PeerThread(swarm, n, cfg, CountsOtherwise if n == "d" else Trainer)
        for n, cfg in _configs(tmp_path, names, rounds_to_trust=1).items()
    }
    finish(peers)
    assert_swarm_contract(tmp_path, peers, names)
    d = peers["d"].trainer
    assert CountsOtherwise.bans == [[swarm.peer_id("a")]]  # d banned a (honest) in round 1...
    assert (
        swarm.peer_id("a") not in swarm.banned_by[swarm.peer_id("d")]
    )  # ...and lifted it on taking the swarm's
    assert [r for why, r in d.loads if why == "realign"][:1] in ([2], [3]), d.loads
    assert realignments() == before + 1
    [hostile] = swarm.injector.tampered_donors
    refused = [why for donor, why in d.refusals if donor == hostile]
    assert refused and "not the one most trusted peers carry" in refused[0], d.refusals
    reputations = {n: p.trainer.reputation.to_dict() for n, p in peers.items()}
    assert all(r == reputations["a"] for r in reputations.values()), reputations
    assert all(p.trainer.reputation.trusted(swarm.peer_id(n)) for n, p in peers.items())


def _configs(tmp_path, names, **verification):
    from tests.memswarm import fast_config

    sections = {
        "swarm": {"min_peers": len(names)},
        "averaging": {"target_group_size": len(names)},
        "verification": {**VERIFY, **verification},
    }
    return {name: fast_config(tmp_path, name, **sections) for name in names}


class HoldsItsNonce(Trainer):
    """A replica that seals but never reveals its nonce (so its partner cannot sketch under the group's seed)."""

    def verify_round(self, group, stats):
        honest_update = self.board.update

        def update(**changes):
            changes.pop("nonce", None)
            changes.pop("digest", None)
            return honest_update(**changes)

        self.board.update = update
        try:
            return super().verify_round(group, stats)
        finally:
            self.board.update = honest_update


def test_a_replica_that_never_reveals_costs_its_partner_the_round_and_gets_nobody_struck(tmp_path):
    """Its partner publishes no sketch rather than one under part of the seed (which a referee, using the
    whole seed, would hold against it): the group is unrevealed, and nobody is convicted."""
    swarm = MemorySwarm()
    names = ["a", "b", "c", "x"]
    cfgs = _configs(tmp_path, names, reveal_timeout_s=2.0)
    peers = {n: PeerThread(swarm, n, cfg, HoldsItsNonce if n == "x" else Trainer) for n, cfg in cfgs.items()}
    finish(peers)
    x = swarm.peer_id("x")
    for name in ("a", "b", "c"):
        trainer = peers[name].trainer
        assert not trainer.reputation.strikes, trainer.reputation.strikes
        judged = [v for _, v in trainer.verdicts if x in v.left_out]
        assert judged and all(v.left_out[x] == Why.UNREVEALED for v in judged), judged
        assert all(x not in v.shares for _, v in trainer.verdicts)
    assert_swarm_contract(tmp_path, peers, ["a", "b", "c"])


def test_two_peers_that_disagree_void_their_rounds_instead_of_retraining_them_forever(tmp_path):
    """With nobody to referee, no work is verified: every round passes with the params unchanged, and both
    peers end the run (never a hang)."""
    swarm = MemorySwarm()
    cfgs = _configs(tmp_path, ["a", "x"])
    peers = {n: PeerThread(swarm, n, cfg, FlipsItsWork if n == "x" else Trainer) for n, cfg in cfgs.items()}
    finish(peers)
    a = peers["a"].trainer
    assert a.rounds_voided == list(range(a.cfg.outer.num_rounds)) and a.rounds_applied == []
    assert not a.reputation.strikes
    assert peers["a"].result.outcome.value == "final"


def test_two_colluders_never_get_an_honest_peer_struck_and_honest_peers_judge_alike(tmp_path):
    """Two peers that send the same wrong work agree with each other when paired together (replicas cannot
    tell; see docs/architecture.md#verification), and dissent with any honest partner: whatever the pairs,
    every honest peer reaches the same verdict each round, and no honest peer is ever struck."""
    swarm = MemorySwarm()
    names = ["a", "b", "c", "x", "y"]
    cfgs = _configs(tmp_path, names)
    peers = {n: PeerThread(swarm, n, cfg, FlipsItsWork if n in "xy" else Trainer) for n, cfg in cfgs.items()}
    finish(peers)
    bad = {swarm.peer_id("x"), swarm.peer_id("y")}
    by_round: dict[int, set[str]] = {}
    for name in ("a", "b", "c"):
        trainer = peers[name].trainer
        assert set(trainer.reputation.strikes) <= bad, trainer.reputation.strikes
        for r, verdict in trainer.verdicts:
            by_round.setdefault(r, set()).add(verdict.digest())
            assert not any(set(g) & bad and set(g) - bad for g in verdict.agreed), verdict
    assert by_round, "no round was judged: nothing above was checked"
    assert all(len(digests) == 1 for digests in by_round.values()), by_round


def test_a_newcomer_refuses_a_donor_whose_reputation_differs_from_the_swarms_under_the_trust_threshold(
    tmp_path, monkeypatch
):
    """A donor offers the swarm's reputation with every count one round higher: the same lists of trusted,
    struck and banned peers (nobody is trusted yet), which is all a newcomer compared before. Taken, its
    counts would differ from everyone else's (an accomplice a round from trust in its eyes alone: their
    assignments would differ). The records carry a digest of the whole reputation: the newcomer refuses that
    donor, takes the state from another, and ends the run judging exactly as the others do."""
    from tests.memswarm import Injector, fast_config
    from tests.test_rounds import slowed_steps, waits_for

    injector = Injector()
    swarm = MemorySwarm(injector)
    names = ["a", "b", "c", "d"]
    cfgs = _configs(tmp_path, names)
    peers: dict[str, PeerThread] = {}

    slowed_steps(monkeypatch, {}, after=waits_for(peers, "e", from_round=3))
    peers.update({n: PeerThread(swarm, n, cfg) for n, cfg in cfgs.items()})
    peers["a"].wait_until(lambda t: t.round >= 2)
    injector.tamper_donation = one_more_round_each  # the newcomer's first download, whoever serves it
    sections = {"verification": VERIFY, "averaging": {"target_group_size": 5}}
    peers["e"] = PeerThread(swarm, "e", fast_config(tmp_path, "e", **sections))
    finish(peers)
    [hostile] = injector.tampered_donors
    e = peers["e"].trainer
    refused = [why for donor, why in e.refusals if donor == hostile]
    assert refused and "is not the one" in refused[0], e.refusals
    assert e.loads and e.reputation.agreed, (e.loads, e.reputation.agreed)
    swarms = peers["a"].trainer.reputation.to_dict()
    assert max(swarms["agreed"].values()) >= 3, swarms
    for name, p in peers.items():
        assert p.trainer.reputation.to_dict() == swarms, name
    assert_swarm_contract(tmp_path, peers, [*names, "e"])


def test_a_peer_back_from_a_pause_settles_the_dispute_of_the_round_it_missed_as_the_swarm_does(tmp_path):
    """A flipper's replica group dissents in round 2; that dispute is settled at round 3's verdict. A
    volunteer's machine is busy through round 2 (its schedule pauses it) and free again as the others gather
    round 3's roster: it comes back, loads round 3's state and is in round 3, never having judged round 2.
    The state it loads carries round 2's dispute (vouched for by the records' digest of the donated
    reputation), so it strikes the flipper for round 2 as the swarm does, rather than judging round 3 one
    strike short of everyone else."""
    swarm = MemorySwarm()
    names = ["a", "b", "c", "x", "p"]
    cfgs = _configs(tmp_path, names, strikes_to_ban=100)  # never banned: x's group dissents every round
    peers: dict[str, PeerThread] = {}
    settled: dict[int, dict] = {}

    def busy() -> str | None:
        others_in_round_3 = all(peers[n].trainer.round >= 3 for n in "abcx")
        return "busy" if peers["p"].trainer.round == 2 and not others_in_round_3 else None

    class PausedThroughRound2(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.schedule = types.SimpleNamespace(check=busy, wait_s=0.0)  # what Schedule offers

        def settle_disputes(self, round_):
            super().settle_disputes(round_)
            settled[round_] = self.reputation.to_dict()

    def waits_for_p(kind: type[Trainer]) -> type[Trainer]:
        class WaitsForP(kind):  # type: ignore[misc, valid-type]
            def _await_roster(self):
                # Round 2's roster waits until p says it is paused (it published round 2 as training first,
                # and would otherwise be in it), round 3's until p is back (loading, a round behind) or in
                # round 3: it is then "coming", and the roster waits for it as for any peer that loads.
                wanted = {2: [(2, PeerState.PAUSED)], 3: [(2, PeerState.LOADING), (3, PeerState.TRAINING)]}
                deadline = time.monotonic() + 60
                while self.round in wanted and time.monotonic() < deadline:
                    r = swarm.read().get(swarm.peer_id("p"))
                    if r is not None and (r.round, r.state) in wanted[self.round]:
                        break
                    time.sleep(0.01)
                super()._await_roster()

        return WaitsForP

    kinds = {"x": waits_for_p(FlipsItsWork), "p": PausedThroughRound2}
    peers.update(
        {n: PeerThread(swarm, n, cfg, kinds.get(n, waits_for_p(Trainer))) for n, cfg in cfgs.items()}
    )
    finish(peers)
    x, p = swarm.peer_id("x"), peers["p"].trainer
    assert p.pauses and p.pauses[0][0] == 2, p.pauses
    assert not any(r == 2 for r, _ in p.verdicts), "p judged round 2: nothing below is checked"
    assert p.loads[0] == ("catch_up", 3), p.loads
    struck = peers["a"].trainer.reputation.strikes.get(x, [])
    assert 2 in struck, ("round 2 had no dispute: nothing below is checked", struck)
    assert 3 in settled and 2 in settled[3]["strikes"].get(x, []), settled.get(3)
    for name in "bcp":
        assert peers[name].trainer.reputation.to_dict() == peers["a"].trainer.reputation.to_dict(), name
    assert_swarm_contract(tmp_path, peers, ["a", "b", "c", "p"])


def test_honest_peers_split_evenly_on_the_reputation_lock_no_newcomer_out():
    """The donor's own say counts with what it serves: with peers at the round split one against one (or two
    against two), no digest has a majority, and the lists decide (they match here: nobody is trusted), as
    they did before records carried digests. A donor against the rest is still refused."""
    from p2ptrain.verify import Reputation
    from tests.test_records import rec

    def offered(counts):
        return {"agreed": counts, "strikes": {}, "banned": []}

    def judge(others, saved):
        me = types.SimpleNamespace(
            reputation=Reputation(rounds_to_trust=9),
            _others=lambda: {r.peer_id: r for r in others},
            log=types.SimpleNamespace(warning=lambda *a, **k: None),
        )
        adopted, _disputes, problem = Trainer._backed_reputation(me, saved, "donor", 5)
        return adopted, problem

    one, two = offered({"a": 1}), offered({"a": 2})
    digest = {"one": Reputation.digest_of(one), "two": Reputation.digest_of(two)}
    split = [rec("b", 5).copy(update={"reputation": digest["two"]})]
    adopted, problem = judge(split, one)
    assert problem is None and adopted is not None and adopted.agreed == {"a": 1}, "1 against 1: the lists"
    split.append(rec("c", 5).copy(update={"reputation": digest["one"]}))
    split.append(rec("d", 5).copy(update={"reputation": digest["two"]}))
    assert judge(split, one)[1] is None, "2 against 2"
    rest = [rec(p, 5).copy(update={"reputation": digest["two"]}) for p in "bcd"]
    adopted, problem = judge(rest, one)
    assert adopted is None and "is not the one 3 of 4" in problem
    adopted, problem = judge(rest, two)
    assert problem is None and adopted is not None and adopted.agreed == {"a": 2}


def test_a_donors_pending_disputes_come_only_with_a_digest_that_vouches_for_them():
    """A dispute strikes whom its reports and its referee's make it: one that a donor alone made up could get
    an honest peer struck in a newcomer's eyes. It is taken where most records of the round carry the digest
    of what the donor serves, and left out where only the lists can be compared."""
    from p2ptrain.verify import SKETCH_WIDTH, Dispute, Report, Reputation, donated
    from tests.test_records import rec

    def judge(others, saved):
        me = types.SimpleNamespace(
            reputation=Reputation(rounds_to_trust=9),
            _others=lambda: {r.peer_id: r for r in others},
            log=types.SimpleNamespace(warning=lambda *a, **k: None),
        )
        return Trainer._backed_reputation(me, saved, "donor", 5)

    reports = tuple(
        Report(p, "cpu/float32", torch.full((SKETCH_WIDTH,), v).double(), 1.0)
        for p, v in [("b", 1), ("x", 2)]
    )
    real = Dispute(4, ("b", "x"), "0/2", 7, "c", reports)
    swapped = (
        Report("b", "cpu/float32", reports[1].sketch, 1.0),
        Report("x", "cpu/float32", reports[0].sketch, 1.0),
    )
    forged = Dispute(4, ("b", "x"), "0/2", 7, "c", swapped)  # b's work as x's: the referee would strike b
    rep = Reputation(rounds_to_trust=9)
    rep.agree(["a"])
    swarms = Reputation.digest_of(donated(rep, [real]))
    records = [rec(p, 5).copy(update={"reputation": swarms}) for p in "bcd"]
    adopted, disputes, problem = judge(records, donated(rep, [real]))
    assert problem is None and adopted is not None and [d.reports[1].peer for d in disputes] == ["x"]
    assert torch.equal(disputes[0].reports[1].sketch, reports[1].sketch)
    adopted, disputes, problem = judge(records, donated(rep, [forged]))
    assert adopted is None and disputes == [] and "is not the one 3 of 4" in problem
    adopted, disputes, problem = judge([rec(p, 5) for p in "bcd"], donated(rep, [real]))
    assert problem is None and adopted is not None and disputes is None, "no digests: the lists, no disputes"
    assert judge([rec(p, 5) for p in "bcd"], donated(rep, []))[1] == [], "none offered: nothing missing"
