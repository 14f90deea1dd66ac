"""The round protocol: how peers agree on rounds without a coordinator, as pure decisions.

Every function here takes what a peer knows (its own round and params hash, the others' progress
records, what it has seen before (:class:`SwarmMemory`), the time) and returns a decision; none of them
touches the network, the model or a clock. The trainer gathers the inputs, calls them, and carries the
decisions out. So every rule below can be tested with a table of records, and peers that know the same
decide the same.

The rules, in the order a round meets them (docs/architecture.md has them in one table):

* **Catch up** (:func:`catch_up`). A peer behind the highest round that a live peer holds params of
  downloads that round's state from a holder of its canonical params (most samples first). A donor
  that fails is asked again later (:class:`DonorBackoff`), never given up on while it is alive.
* **Never train a round the swarm has left behind** (:func:`behind`). A peer that has seen the swarm at a
  later round trains no round before it: it keeps asking. If the swarm finished and nobody serves its
  final state, it stops and says so. If nobody gives it the newer state for ``swarm.catch_up_timeout_s``
  (its holders crashed, or cannot serve it), it goes on from its own state when one round behind, and
  stops when further behind.
* **Roster** (:func:`roster`). A round's data shards go to the sorted ids of the peers of the round.
* **Barrier** (:func:`barrier`). After its inner phase a peer waits for every live peer that will train
  its round (those in it, and those one round behind) to finish theirs, until a deadline; if the swarm
  moves past its round meanwhile, its pseudo-gradient is stale: it drops it and catches up. A peer whose
  params nobody else holds (:func:`lone`) waits for every peer behind it: they cannot load its state.
* **Settle the group** (:func:`settle`). Past the barrier a peer says whom it found ready, and averages
  with everyone its group's members name (and so on): peers whose barriers saw a late peer differently
  still go into one all-reduce.
* **Canonical params** (:func:`rebase_donors`). Peers at a barrier must hold the same params. If ours
  differ from the canonical ones (:func:`p2ptrain.records.canonical_hash`), we take them and keep our
  inner progress on top (a rebase).
* **Fallback** (:func:`may_step_alone`). An all-reduce that fails leaves a peer with its own
  pseudo-gradient; it tries again while a groupmate is still averaging in its round
  (:func:`still_averaging`), and then may apply it alone only if nobody is past its round yet.
* **Finish** (:func:`linger`, :func:`final_verdict`). A peer that finished the last round serves its
  final state while any live peer is behind, loading or holds other final params (up to
  ``swarm.linger_s``); it adopts the canonical final params if its own differ. It ends with the
  swarm's final model, or says it does not have it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum

from p2ptrain.records import PeerState, ProgressRecord, Vote, canonical_hash, live

Records = Mapping[str, ProgressRecord]
"""Other peers' records by peer id, as read from the swarm: unexpired, possibly ``left``."""


@dataclass(frozen=True)
class Me:
    """What a peer knows of itself, for the decisions below."""

    peer_id: str
    round: int
    params_hash: str
    last_group_size: int = 0
    serves: bool = True

    @property
    def vote(self) -> Vote:
        return Vote(self.params_hash, self.last_group_size, self.serves)


# ------------------------------------------------------------------------------------------ credibility


def credible(others: Records, my_round: int) -> dict[str, ProgressRecord]:
    """The records to believe: a claim to hold params of a round ahead of ours counts only if two peers
    report that round with the same params hash, or fewer than two other peers hold params at all.

    Records are bound to identities, so this takes two identities, not one record: a single peer cannot make
    the swarm think it is behind, wait for it, or load its params, by claiming a later round. An honest peer
    that is alone ahead (it got the average when its groupmates did not) is then not followed; its
    groupmates go on (retry, or step alone) and the canonical-params vote of the next round puts everyone on
    one set of params. Peers that are loading hold no params, so restarted peers do not outvote the one
    peer ahead of them; but at a run's start (our round 0) a peer loading into round 0 holds the run's initial
    params, as we do: it counts as a holder, so that one insider that claims round 1 as the run starts is not
    followed by every peer for ``swarm.catch_up_timeout_s`` (it was: 2 honest peers of the attack benchmark
    lost 240 s asking it for its state, 2026-12-06).
    """
    is_vouched = _vouching(others, starting=my_round == 0)
    return {
        pid: r
        for pid, r in others.items()
        if not (r.holds_params and r.round > my_round) or is_vouched(r.round, r.params_hash)
    }


def unsettled(me: Me, others: Records) -> bool:
    """Peers hold params of a round past ours, yet none of them credibly (:func:`credible`): the swarm read
    mid-outer-step (one peer has published its step, its groupmates not yet), or a dead peer's record that
    lingers. A newcomer that decided on such a reading would see nobody ahead and train a round alone."""
    return _past(me, others) and not _past(me, credible(others, me.round))


def vouched(others: Records, round: int, params_hash: str) -> bool:
    """Whether peers vouch for holding ``params_hash`` in ``round``: two of them, or the only other holder."""
    return _vouching(others)(round, params_hash)


def _vouching(others: Records, starting: bool = False) -> Callable[[int, str], bool]:
    """:func:`vouched` for one reading of the records, counted once (``starting``: see :func:`credible`)."""
    holders = [r for r in others.values() if r.holds_params]
    backers = Counter((r.round, r.params_hash) for r in holders)
    fresh = [r for r in others.values() if starting and r.state == PeerState.LOADING and r.round == 0]
    quorum = max(1, min(2, len(holders) + len(fresh)))
    return lambda round, params_hash: backers[(round, params_hash)] >= quorum


# ----------------------------------------------------------------------------------------- catching up


@dataclass(frozen=True)
class CatchUp:
    """A peer is behind: the round to load, and whom to ask for it, in order."""

    round: int
    params_hash: str
    """The canonical params hash of ``round`` among its holders."""
    donors: list[str]
    """Holders of the canonical params, most samples first, without those we should not ask yet."""
    resting: int = 0
    """Holders left out of ``donors`` because they failed recently (see :class:`DonorBackoff`)."""


def catch_up(me: Me, others: Records, *, resting: Iterable[str] = ()) -> CatchUp | None:
    """The state to load if live peers hold params of a later round than ours, else None.

    Args:
        resting: donors not to ask now (they failed recently); they are counted in ``CatchUp.resting``.
    """
    ahead = [r for r in others.values() if r.holds_params and r.round > me.round]
    if not ahead:
        return None
    target = max(r.round for r in ahead)
    holders = [r for r in ahead if r.round == target]
    canon = canonical_hash(Vote.of(r) for r in holders)
    assert canon is not None  # holders hold params, so each has a hash
    ordered = sorted(
        (r for r in holders if r.params_hash == canon), key=lambda r: (-r.samples_total, r.peer_id)
    )
    skip = set(resting)
    donors = [r.peer_id for r in ordered if r.peer_id not in skip]
    return CatchUp(target, canon, donors, resting=len(ordered) - len(donors))


class DonorBackoff:
    """When to ask a donor that failed us again: after ``base_s``, doubling per failure up to ``max_s``.

    It may have been busy, or its upload slow; only :func:`behind` gives up on it, after
    ``swarm.catch_up_timeout_s`` without the newer state.
    """

    def __init__(self, base_s: float, max_s: float):
        self.base_s, self.max_s = base_s, max_s
        self._failures: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def failed(self, donor: str, now: float) -> None:
        n = self._failures[donor] = self._failures.get(donor, 0) + 1
        self._until[donor] = now + min(self.max_s, self.base_s * 2 ** (n - 1))

    def succeeded(self, donor: str) -> None:
        self._failures.pop(donor, None)
        self._until.pop(donor, None)

    def resting(self, now: float) -> set[str]:
        """Donors not to ask at ``now``."""
        return {d for d, until in self._until.items() if until > now}

    def next_try(self, now: float) -> float:
        """The earliest time a resting donor may be asked again (``now`` if none rests)."""
        return min((t for t in self._until.values() if t > now), default=now)


class SwarmMemory:
    """What a peer has seen of the swarm over time, beyond the records alive right now.

    A peer that finished and left, or crashed, takes its record with it; what it showed stays here. The
    heartbeat feeds every reading of the records into it (also while the peer trains), and checkpoints
    keep it (:meth:`to_dict`), so that a restarted peer still knows that the swarm finished without it.
    Thread-safe: the heartbeat thread observes while the trainer decides.
    """

    def __init__(self, num_rounds: int):
        self.num_rounds = num_rounds
        self._floor = -1
        self._claims: dict[str, int] = {}
        self.swarm_finished = False
        """Some peer finished the run: a final model of this swarm exists."""
        self.behind_since: float | None = None
        """Since when we have been behind without getting the newer state (see :func:`behind`)."""
        self._final_votes: dict[str, Vote] = {}
        self._ignored: set[str] = set()
        self._waited_out: dict[str, int] = {}
        # Of _waited_out, those marked when nobody was ready: their progress (progress_of) then.
        self._cut_off: dict[str, Progress] = {}
        self._unsaid: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def highest_round(self) -> int:
        """The highest round a peer (not one we gave up on) has been seen holding params of: what a live peer's
        record credibly shows now, and what a gone peer's showed last."""
        with self._lock:
            return self._highest()

    def _highest(self) -> int:
        return max(self._floor, *self._claims.values()) if self._claims else self._floor

    def observe(
        self, records: Records, my_round: int | None = None, *, distrusted: Iterable[str] = ()
    ) -> None:
        """Remember what other peers' records show (only what is :func:`credible` at ``my_round``).

        A peer whose record is here speaks for itself: a claim it made that is no longer credible, or that it
        no longer makes, is forgotten, as is any claim of a ``distrusted`` peer (banned, refused). A gone
        peer's last claim stays. A lone insider's claim of round 1, read as a run starts before any honest
        record had arrived, was credible in that reading, and was remembered after the honest records
        outvoted it: its reader waited ``swarm.catch_up_timeout_s`` for a round nobody held (138 s, 1 run of
        3 of the attack benchmark, 2026-12-06)."""
        believed = records if my_round is None else credible(records, my_round)
        with self._lock:
            for pid, then in list(self._cut_off.items()):
                r = records.get(pid)
                if r is not None and progress_of(r) != then:
                    # It moved on since: we were cut off from it, it did not hang. Wait for it again.
                    self._cut_off.pop(pid, None)
                    self._waited_out.pop(pid, None)
            for pid in distrusted:
                self._claims.pop(pid, None)
            for pid, r in records.items():
                if pid not in believed or not r.params_hash or r.state == PeerState.LOADING:
                    self._claims.pop(pid, None)
                    continue
                if r.round >= self.num_rounds and r.state in (PeerState.DONE, PeerState.LEFT):
                    self._final_votes[pid] = Vote.of(r)
                    self.swarm_finished = True
                if pid not in self._ignored:
                    self._claims[pid] = r.round

    def final_votes(self) -> list[Vote]:
        """The vote of every peer seen with final params (round ``num_rounds``, done or left)."""
        with self._lock:
            return list(self._final_votes.values())

    WAITED_OUT_ROUNDS = 16

    def waited_out(self, my_round: int) -> set[str]:
        """Peers a barrier waited a whole timeout for in the last ``WAITED_OUT_ROUNDS`` rounds, that we have not
        averaged with since (an honest peer that was slow once is waited for again after that)."""
        return self._recent(self._waited_out, my_round)

    def waited_out_on(
        self,
        peers: Iterable[str],
        round: int,
        *,
        nobody_ready: Mapping[str, Progress] | None = None,
    ) -> None:
        """Mark ``peers`` as waited out in ``round``.

        ``nobody_ready``: the barrier found none of the round's peers ready, and these of ``peers`` did not
        move during its wait, so it cannot tell whether they hung or we are cut off from them (a network
        outage times every barrier out at once: each peer then marked every other, and averaged alone for 16
        rounds). It maps each of them to its progress (:func:`progress_of`). Such a mark is lifted as soon as
        the peer is seen to move on; a hung peer's record stays as it was, and keeps its mark. A peer that
        moved during the wait is slow, not cut off: it gets the usual mark (one timeout per 16 rounds).
        """
        peers = list(peers)
        with self._lock:
            self._waited_out.update({p: round for p in peers})
            for p in peers:
                self._cut_off.pop(p, None)
                if nobody_ready is not None and p in nobody_ready:
                    self._cut_off[p] = nobody_ready[p]

    def unsaid(self, my_round: int) -> set[str]:
        """Peers :func:`settle` waited for in vain in the last ``WAITED_OUT_ROUNDS`` rounds: not waited for
        again until then (a peer that never says whom it goes with costs one wait per 16 rounds at most)."""
        return self._recent(self._unsaid, my_round)

    def unsaid_on(self, peers: Iterable[str], round: int) -> None:
        self._mark(self._unsaid, peers, round)

    def _recent(self, marks: dict[str, int], my_round: int) -> set[str]:
        with self._lock:
            return {p for p, r in marks.items() if my_round < r + self.WAITED_OUT_ROUNDS}

    def _mark(self, marks: dict[str, int], peers: Iterable[str], round: int) -> None:
        with self._lock:
            marks.update({p: round for p in peers})

    def averaged_with(self, peers: Iterable[str]) -> None:
        with self._lock:
            for p in peers:
                self._waited_out.pop(p, None)
                self._cut_off.pop(p, None)

    def give_up_on(self, peers: Iterable[str], my_round: int) -> None:
        """We could not get the newer state these peers hold: go on from ours, and stop counting them as
        ahead (until they are no longer ahead of us)."""
        with self._lock:
            self._ignored |= set(peers)
            self._floor = my_round
            self._claims = {p: r for p, r in self._claims.items() if r <= my_round}
            self.behind_since = None

    def visible(self, others: Records, my_round: int) -> dict[str, ProgressRecord]:
        """The records that decisions look at: the :func:`credible` ones, without the peers ahead of us that we
        gave up on."""
        with self._lock:
            self._ignored -= {pid for pid, r in others.items() if r.round <= my_round}
            kept = {pid: r for pid, r in others.items() if pid not in self._ignored}
        return credible(kept, my_round)

    def to_dict(self) -> dict:
        with self._lock:
            return {
                "highest_round": self._highest(),
                "swarm_finished": self.swarm_finished,
                "final_votes": {
                    pid: [v.params_hash, v.last_group_size, v.serves] for pid, v in self._final_votes.items()
                },
            }

    def restore(self, saved: Mapping) -> None:
        """Merge what a checkpoint kept (:meth:`to_dict`); malformed parts are ignored."""
        with self._lock:
            if isinstance(saved.get("highest_round"), int):
                self._floor = max(self._floor, saved["highest_round"])
            self.swarm_finished = self.swarm_finished or saved.get("swarm_finished") is True
            votes = saved.get("final_votes")
            for pid, vote in (votes if isinstance(votes, dict) else {}).items():
                # 2 items: a checkpoint from before `serves`
                if not (isinstance(vote, list) and len(vote) in (2, 3) and isinstance(vote[0], str)):
                    continue
                if not isinstance(vote[1], int) or isinstance(vote[1], bool) or vote[1] < 0:
                    continue
                serves = len(vote) == 2 or vote[2] is not False
                self._final_votes.setdefault(str(pid), Vote(vote[0], vote[1], serves))


class BehindState(str, Enum):
    NO = "no"
    """Not behind: train."""
    LOAD = "load"
    """Behind: load the newer state from ``plan.donors``."""
    WAIT = "wait"
    """Behind, and nobody to ask right now: wait (a donor rests, or a peer ahead may come back)."""
    GO_ON = "go_on"
    """Behind for ``swarm.catch_up_timeout_s`` by one round only, without getting the newer state (its holders
    crashed, or cannot serve it): go on from our own state; that one round's progress is lost, not forked."""
    STRANDED = "stranded"
    """Stop: see :class:`Stranded`."""


class Stranded(str, Enum):
    """Why a peer behind the swarm stops rather than train on (exit code 3)."""

    SWARM_FINISHED = "the swarm finished the run and no live peer serves its final state"
    TOO_FAR_BEHIND = (
        "no live peer served the swarm's newer state, and this peer is more than one round behind: "
        "training on alone would redo rounds the swarm has left behind"
    )


@dataclass(frozen=True)
class Behind:
    state: BehindState
    plan: CatchUp | None = None
    ahead: list[str] = field(default_factory=list)
    """GO_ON: the peers ahead that we give up on."""
    why: Stranded | None = None


def behind(
    me: Me, others: Records, memory: SwarmMemory, *, now: float, resting: Iterable[str], timeout_s: float
) -> Behind:
    """Whether a peer is behind the swarm, and what to do about it.

    Behind means: a live peer holds params of a later round, or one was seen to (it may have crashed or
    left since). A behind peer never trains a round the swarm has left behind; it asks the holders of the
    newer state (``LOAD``), or waits for one (``WAIT``). If the swarm finished and nobody alive serves the
    final state, it stops (``STRANDED``). If ``timeout_s`` passes without getting the newer state, it goes on
    from its own state when it is one round behind (``GO_ON``: the holders crashed, or cannot serve it; a
    crash must not end the swarm), and stops when it is further behind (its state is not the swarm's).
    Updates ``memory.behind_since``.

    Args:
        others: the records to decide on (:meth:`SwarmMemory.visible`).
        resting: donors not to ask now (:class:`DonorBackoff`).
    """
    plan = catch_up(me, others, resting=resting)
    ahead_round = max(memory.highest_round, plan.round if plan else -1)
    if ahead_round <= me.round:
        memory.behind_since = None
        return Behind(BehindState.NO)
    if memory.behind_since is None:
        memory.behind_since = now
    finished = memory.swarm_finished and me.round < memory.num_rounds
    if finished and plan is None:
        return Behind(BehindState.STRANDED, why=Stranded.SWARM_FINISHED)
    if now - memory.behind_since < timeout_s:
        if plan is not None and plan.donors:
            return Behind(BehindState.LOAD, plan)
        return Behind(BehindState.WAIT, plan)
    if finished:
        return Behind(BehindState.STRANDED, why=Stranded.SWARM_FINISHED)
    if me.round < ahead_round - 1:
        return Behind(BehindState.STRANDED, why=Stranded.TOO_FAR_BEHIND)
    ahead = sorted(pid for pid, r in others.items() if r.holds_params and r.round > me.round)
    return Behind(BehindState.GO_ON, plan, ahead=ahead)


# --------------------------------------------------------------------------------------------- a round


def roster(me: Me, others: Records) -> tuple[int, int]:
    """Our rank and the world size of our round, which pick our data shard: the sorted ids of the live peers
    in it, us included, and of those still in the previous round's sync.

    Peers that see different rosters train overlapping data (shards are slices of one permutation: rank 0
    of any world starts at the same windows). So peers loading into our round count: they are about to
    train it (at the start of a run every peer is ``loading`` until its first inner phase). So do peers
    still averaging the round before ours: the groupmates we just averaged with step into our round
    milliseconds after us, and a peer that starts its inner phase before their new records have arrived
    saw itself alone, or nearly, and trained a slice that another peer trained too (3 real peers of the
    default experiment: in 15 rounds of 16, one peer or more trained another's data; the robust aggregate
    then left honest parts out, as far from two alike). A verifiable round waits for them instead
    (``Trainer._await_roster``).
    """
    ordered = sorted(_in_or_coming(me, others))
    return ordered.index(me.peer_id), len(ordered)


def roster_ids(me: Me, others: Records) -> list[str]:
    """The sorted ids of the live peers of our round, us included (see :func:`roster`)."""
    return sorted(_live_in(others, me.round) | {me.peer_id})


def next_roster(me: Me, others: Records) -> tuple[int, int]:
    """Our rank and world size in the round after ours, which we train while ours is averaged
    (``outer.overlap``): the peers already in it, and every peer that will be: those in our round, averaging
    it (as we do, training the next one meanwhile) or still training it, and those still averaging the round
    before. Our barrier has passed, so a peer still training our round was left out of its group (a barrier
    timeout) or is behind: it still counts, since it comes into the next round as it catches up, and a
    roster that left such peers out trained the windows they train (3 real peers, when the barrier ran
    beside training: a world of 1 or 2 in 30 of 48 inner phases)."""
    ordered = sorted(_in_or_coming(me, others) | _live_in(others, me.round + 1))
    return ordered.index(me.peer_id), len(ordered)


def _live_in(others: Records, round_: int) -> set[str]:
    """The peers loading into, training or averaging ``round_``."""
    live = (PeerState.LOADING, PeerState.TRAINING, PeerState.AVERAGING)
    return {pid for pid, r in others.items() if r.round == round_ and r.state in live}


def _in_or_coming(me: Me, others: Records) -> set[str]:
    """Us, the live peers of our round, and those still averaging the round before it: they step into it."""
    previous = {
        pid for pid, r in others.items() if r.round == me.round - 1 and r.state == PeerState.AVERAGING
    }
    return _live_in(others, me.round) | previous | {me.peer_id}


class BarrierState(str, Enum):
    GO = "go"
    """Every live peer of our round is ready (or the deadline passed): average with ``ready``."""
    WAIT = "wait"
    """Some peers of our round are still training."""
    STALE = "stale"
    """A peer is past our round: our pseudo-gradient is stale; catch up instead."""


@dataclass(frozen=True)
class Barrier:
    state: BarrierState
    ready: list[ProgressRecord] = field(default_factory=list)
    """The peers of our round that finished their inner phase: our group."""
    waiting_for: list[str] = field(default_factory=list)
    """Peers of our round still training (or loading into it): why we wait, or whom we left out."""
    timed_out: bool = False


def barrier(
    me: Me,
    others: Records,
    *,
    now: float,
    deadline: float,
    swarm_finished: bool = False,
    num_rounds: int = 0,
    not_waited: Iterable[str] = (),
) -> Barrier:
    """The barrier after our inner phase: go, wait, or give up the round as stale.

    We wait for the live peers that will train our round: those in it (loading into it included), and
    those one round behind, in their inner phase, sync or catch-up: they will step into ours or load our
    state (they see us ahead), and then train it. Without them, a peer whose last sync failed would find the
    others gone ahead alone, round after round; and a peer ahead that cannot serve its state would run away
    alone while the others wait for it (they give up on it after ``swarm.catch_up_timeout_s``, which is
    shorter than the barrier's deadline, and meet it again in its round).

    A swarm that finished the run (``swarm_finished``, seen by this peer at any time) makes a round before
    ``num_rounds`` stale even if the peers that finished are gone: their final model exists.

    ``not_waited``: peers we already waited a whole timeout for and have not averaged with since
    (:meth:`SwarmMemory.waited_out`): they join the group if they are ready, but nobody waits for them for
    16 rounds, so a record that never gets ready (a hung peer, or a hostile one) costs one timeout per 16
    rounds at most.
    """
    if _past(me, others) or (swarm_finished and me.round < num_rounds):
        return Barrier(BarrierState.STALE)
    coming = (PeerState.LOADING, PeerState.TRAINING, PeerState.AVERAGING)
    same = [r for r in others.values() if r.round == me.round and r.state in coming]
    behind = [r for r in others.values() if r.round == me.round - 1 and r.state in coming]
    ready = sorted((r for r in same if r.state == PeerState.AVERAGING), key=lambda r: r.peer_id)
    skip = set(not_waited)
    if lone(me, others):
        # Nobody can load our state: those behind us come to our round by training, or never meet us.
        far = range(me.round - LONE_WAITS_BEHIND, me.round - 1)
        behind += [r for r in others.values() if r.round in far and r.state in TRAINS]
    waiting = sorted(
        pid
        for pid in [r.peer_id for r in same if r.state != PeerState.AVERAGING] + [r.peer_id for r in behind]
        if pid not in skip
    )
    if not waiting:
        return Barrier(BarrierState.GO, ready)
    if now >= deadline:
        return Barrier(BarrierState.GO, ready, waiting, timed_out=True)
    return Barrier(BarrierState.WAIT, ready, waiting)


Progress = tuple[int, PeerState, int]

TRAINS = (PeerState.TRAINING, PeerState.AVERAGING)
"""The states of a peer that trains rounds (not one paused, loading, done or gone)."""

LONE_WAITS_BEHIND = 16
"""A lone peer waits for peers behind it by this many rounds at most: further behind (a newcomer that found
nobody credible to load from, say), meeting them would cost us as many rounds of waiting."""


def progress_of(record: ProgressRecord) -> Progress:
    """Where a peer is: its round, its state, and the samples it trained in its round (its heartbeat tells
    them as it trains). A peer that trains moves on; a hung one, or one we are cut off from, does not."""
    return record.round, record.state, record.samples_round


def waits_on(me: Me, others: Records, decision: Barrier, since: Mapping[str, int] | None = None) -> bool:
    """Whether a barrier that timed out waits another timeout rather than steps alone: a :func:`lone` peer
    that found nobody ready, the first time (``since`` None), and then as long as a peer it waits for came
    a round closer since the last time (``since``: each peer's round then). Stepping alone would only take
    it further from the peers it has to meet: a peer behind it whose rounds take longer than a barrier
    timeout never caught up with a lone peer that stepped at each timeout. A peer that comes no closer
    (hung, cut off, or a record that only pretends to train) costs two timeouts; one that comes closer
    a round at a time, at most as many as it is rounds behind (:data:`LONE_WAITS_BEHIND`)."""
    if not (decision.timed_out and not decision.ready and lone(me, others)):
        return False
    if since is None:
        return True
    return any(p in others and others[p].round > since.get(p, others[p].round) for p in decision.waiting_for)


def lone(me: Me, others: Records) -> bool:
    """Whether we hold params that no other peer holds (our round and params hash), while two others or more
    hold params: our claim is then credible to nobody (:func:`credible`), and a peer behind us can never
    load our state.

    A swarm split (every barrier of a round timed out: a network outage, an overloaded machine) leaves each
    peer with params of its own, stepped alone, the fast ones further than the slow ones. If the peers ahead
    ran on, those behind never caught up with them, and each trained alone to the end (4 in-memory peers
    cut off from each other for 4 rounds never averaged together again in the 12 rounds left; in the
    verification benchmark, 6 of 21 runs on an overloaded machine ended with 4 sets of params). So a lone
    peer also waits at its barrier for every peer behind it that trains: it comes to our round by training,
    and the canonical vote of the round they meet in (:func:`rebase_donors`) makes their params one. A peer
    that averaged with anyone last round holds what its groupmates hold, and is not lone.
    """
    holders = [r for r in others.values() if r.state in TRAINS and r.params_hash]
    return len(holders) >= 2 and not any(
        r.round == me.round and r.params_hash == me.params_hash for r in holders
    )


@dataclass(frozen=True)
class Settled:
    done: bool
    """Whether the group is settled (or the wait for it ran out): average with ``group``."""
    group: list[str]
    """Everyone named, transitively, by the group our barrier found ready, us included (sorted), but for those
    that are not ready in our round."""
    waiting_for: list[str] = field(default_factory=list)
    """Peers in it that are not ready, or have not said whom they go with: why we wait (or, when ``done``,
    whom we waited for in vain)."""


def settle(
    me: str,
    round: int,
    mine: Iterable[str],
    others: Records,
    *,
    timed_out: bool,
    not_waited: Iterable[str] = (),
) -> Settled:
    """The round's group, from ours (``mine``: whom our barrier found ready) and the groups its members
    published (``ProgressRecord.group``, averaging.settled_groups).

    Peers that pass a barrier a moment apart can find different peers ready: one that turned ready in
    between (one nobody waits for: a peer a barrier timed out on, a paused one) is in one group and not in the
    other. Each would name its own leader (``averaging.barrier_leader``) and go into its own all-reduce: the
    round loses the work of those left in the smaller one. So each peer adds everyone the members of its
    group name, and those they name, and so on, and waits until each of them is ready and has said whom it
    goes with. Peers whose groups reach each other end with the same group. A peer that turned ready after
    everyone else had passed (nobody named it) names a larger group than theirs, and only its own attempt
    suffers; it is never in their way.

    At ``timed_out`` a peer that never got ready is left out, and one that is ready but never said whom it
    goes with (a crashed peer, a hostile one) stays in: someone saw it ready. ``not_waited``: peers we waited
    for in vain in a recent round (:meth:`SwarmMemory.unsaid`), which cost no second wait for a while.
    """
    ready = {pid for pid, r in others.items() if r.round == round and r.state == PeerState.AVERAGING}
    group = {me, *mine}
    frontier = sorted(group - {me})
    while frontier:
        record = others.get(frontier.pop())
        if record is None or record.peer_id not in ready:
            continue
        named = set(record.group) - group
        group |= named
        frontier += sorted(named)
    unready = {p for p in group - {me} if p not in ready}
    # As the barrier: those still in our round, or the one before, may yet get ready in ours.
    coming = _live_in(others, round) | _live_in(others, round - 1)
    unsaid = {p for p in group - {me} if p in ready and not others[p].group}
    waiting = sorted(((unready & coming) | unsaid) - set(not_waited))
    return Settled(timed_out or not waiting, sorted(group - unready), waiting)


def rebase_donors(me: Me, group: Iterable[ProgressRecord]) -> list[str] | None:
    """None if our params are the canonical ones of our group; else the holders of the canonical ones."""
    group = list(group)
    canon = canonical_hash([me.vote, *(Vote.of(r) for r in group)])
    if canon == me.params_hash:
        return None
    holders = [r for r in group if r.params_hash == canon]
    return [r.peer_id for r in sorted(holders, key=lambda r: not r.serves)]  # those that serve first


def may_step_alone(me: Me, others: Records, *, swarm_finished: bool = False) -> bool:
    """After a failed all-reduce: apply our own pseudo-gradient only if nobody is past our round yet, and
    the swarm has not finished. Otherwise our step would fork the params: the swarm's state of the next round
    exists, and we load it.
    """
    return not _past(me, others) and not swarm_finished


def still_averaging(me: Me, others: Records, group: Iterable[str]) -> list[str]:
    """After every attempt at our round's all-reduce failed: the groupmates (``group``, as our barrier
    settled it) that may still average with us, so that one more attempt could meet them. Empty once a peer
    is past our round (its state exists: we load it, :func:`may_step_alone`).

    A groupmate can still be in an attempt of its own when ours have run out: one stuck with a staller
    (a whole ``averaging.next_chunk_timeout_s`` or two) while we were refused at once, or told apart from
    it by a hostile leader. Had we stepped alone, its work would be lost when it came out (it loads our
    state); both search again instead. A groupmate counts if its record still says it is averaging in our
    round, and one of us takes calls (two clients cannot average with each other).
    """
    if _past(me, others):
        return []
    return sorted(
        pid
        for pid in set(group) - {me.peer_id}
        if (r := others.get(pid)) is not None
        and r.round == me.round
        and r.state == PeerState.AVERAGING
        and (me.serves or r.serves)
    )


def _past(me: Me, others: Records) -> bool:
    return any(r.holds_params and r.round > me.round for r in others.values())


# ------------------------------------------------------------------------------------------- the end


def evaluator(me: str, group: Iterable[str], round: int, every: int = 1) -> str | None:
    """Who evaluates the params a group holds after ``round``'s outer step (``data.eval_by: one``), or None if
    nobody does: only every ``every`` rounds are evaluated (``data.eval_every``: after rounds every - 1,
    2 * every - 1, ...). Every peer of an averaging group holds the same params, so one evaluation is
    enough: the group's members (``group``, as the all-reduce gathered them; empty if we stepped alone) take
    turns, one evaluated round each."""
    if (round + 1) % every:
        return None
    members = sorted(set(group) | {me})
    return members[(round // every) % len(members)]


class LingerState(str, Enum):
    LEAVE = "leave"
    """Every live peer finished with our final params: nobody needs us."""
    STAY = "stay"
    """Someone is behind, loading, or finished with other params: keep serving our state."""
    ADOPT = "adopt"
    """Our final params are not the canonical ones: load them from ``donors``."""


@dataclass(frozen=True)
class Linger:
    state: LingerState
    donors: list[str] = field(default_factory=list)
    waiting_for: list[str] = field(default_factory=list)


def linger(me: Me, others: Records, memory: SwarmMemory) -> Linger:
    """What a peer that finished the last round does next. ``memory`` holds the final votes seen so far."""
    canon = final_params_hash(me, memory)
    if canon != me.params_hash:
        live_holders = [
            r.peer_id
            for r in others.values()
            if r.state == PeerState.DONE and r.round == me.round and r.params_hash == canon
        ]
        return Linger(LingerState.ADOPT, donors=live_holders)
    waiting = sorted(
        pid
        for pid, r in live(others).items()
        if not (r.state == PeerState.DONE and r.round == me.round and r.params_hash == me.params_hash)
    )
    return Linger(LingerState.STAY if waiting else LingerState.LEAVE, waiting_for=waiting)


def final_params_hash(me: Me, memory: SwarmMemory) -> str | None:
    """The swarm's final params: the canonical ones among ours and every final state we saw."""
    return canonical_hash([me.vote, *memory.final_votes()])


def final_verdict(me: Me, memory: SwarmMemory) -> bool:
    """Whether our final params are the swarm's."""
    return final_params_hash(me, memory) == me.params_hash
