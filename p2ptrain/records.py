"""The progress record every peer publishes, and the pure functions that read a set of them.

A record is what one peer tells the swarm about itself: its round, its state, a hash of its global
params, its samples. Records travel through the DHT signed by their peer (``swarm.py``); everything
here is plain data and arithmetic, with no network, so that the round protocol (``protocol.py``), the
metrics and ``p2ptrain status`` can all be tested with tables of records.

Every field is bounded: a record is something a stranger wrote, and the schema validator of every DHT
node refuses one that is out of bounds before it is stored.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

# hivemind's SchemaValidator speaks pydantic v1; the DHT record models use its compatibility module.
from pydantic.v1 import BaseModel, StrictBool, conbytes, confloat, conint, conlist, constr, validator

MAX_COUNT = 2**53
"""Largest integer a record may carry (exact in a float64, far beyond any real sample count)."""
MAX_RATE = 1e12
"""Largest throughput a record may claim, in samples per second."""
MAX_FLOPS = 1e20
"""Largest compute speed a record may claim, in FLOP/s."""
SKETCH_VALUES = 1024
"""Values in a verification sketch (verify.SKETCH_WIDTH)."""
MAX_WIRE_PARTS = SKETCH_VALUES
"""The most all-reduce parts a verifiable round can bind (one sketch bucket each, at least): 1024 parts of
hivemind's 512 KiB are about 500M parameters at int8."""
PART_DIGEST_BYTES = 16
MAX_REPLICAS = 3
"""The most replicas per shard (verification.replicas); verify.assign may add one lone peer to a group."""
MAX_LISTED = 256
"""The most peers a record lists as trusted, struck or banned (what does not fit is left out)."""


class PeerState(str, Enum):
    """Where a peer is in its round. Published in its record; read by every other peer."""

    LOADING = "loading"
    """Joining or behind the swarm: downloading the swarm's state. Holds no params others should use."""
    TRAINING = "training"
    """In its inner phase of ``round``."""
    AVERAGING = "averaging"
    """Finished its inner phase of ``round``: at the barrier or in the all-reduce."""
    PAUSED = "paused"
    """Its schedule paused it (the volunteer's machine is busy, on battery, or outside its hours): nobody
    waits for it or counts it in a round; it catches up when it resumes."""
    DONE = "done"
    """Finished the run; holds the final params and serves them while others finish."""
    LEFT = "left"
    """Shut down. Ignore it, even before its record expires."""


MAX_PEER_ID = 64
"""The longest peer id a record names (libp2p's base58 ids: 46 characters for RSA keys, 52 for ed25519, 53
for secp256k1). With 128, a record of the largest size was 102 kB; it was 69 kB with that, and is 77 kB
since a roster names each member's class. A DHT node keeps the latest 3 MiB of the run's records
(dhtstorage.MAX_KEY_BYTES), so that its answer to a read fits in one 4 MiB message: 40 of the largest."""


class ProgressRecord(BaseModel):
    """What a peer tells the swarm about itself. Stored signed; read by every peer and by monitors."""

    peer_id: constr(strict=True, min_length=1, max_length=MAX_PEER_ID)  # type: ignore[valid-type]
    """libp2p peer id (base58), used to download state from this peer."""
    round: conint(strict=True, ge=0, le=MAX_COUNT)  # type: ignore[valid-type]
    """The outer round this peer is in (its params are the global params of this round)."""
    state: PeerState
    """See :class:`PeerState`."""
    params_hash: constr(strict=True, regex=r"^[0-9a-f]{0,64}$")  # type: ignore[valid-type]
    """Short hash of this peer's global params and outer momentum of ``round`` (``DiLoCo.params_hash``):
    peers of one round must agree on it."""
    samples_round: conint(strict=True, ge=0, le=MAX_COUNT)  # type: ignore[valid-type]
    """Samples processed in this round's inner phase so far."""
    samples_total: conint(strict=True, ge=0, le=MAX_COUNT)  # type: ignore[valid-type]
    """Samples processed since this peer started."""
    samples_per_s: confloat(strict=True, ge=0.0, le=MAX_RATE)  # type: ignore[valid-type]
    """Recent inner-phase throughput."""
    last_group_size: conint(strict=True, ge=0, le=MAX_COUNT)  # type: ignore[valid-type]
    """Size of the all-reduce group of this peer's last outer step (1: it averaged alone)."""
    device: constr(strict=True, max_length=16)  # type: ignore[valid-type]
    """cpu, cuda or mps."""
    time: confloat(strict=True, ge=0.0, le=1e11)  # type: ignore[valid-type]
    """Wall-clock time of the record (seconds since the epoch)."""
    seen: conint(strict=True, ge=0, le=MAX_COUNT) = 0  # type: ignore[valid-type]
    """How many live peers (itself included) this peer sees."""
    view: constr(strict=True, max_length=16) = ""  # type: ignore[valid-type]
    """Short hash of the sorted ids of the live peers this peer sees (see :class:`SplitWatch`)."""
    serves: StrictBool = True
    """Whether it serves its state: False for a client-mode peer, which nobody can download from."""
    # What it contributes (`p2ptrain status`, the dashboard): seed 002's "who contributes what".
    benchmark_samples_per_s: confloat(strict=True, ge=0.0, le=MAX_RATE) = 0.0  # type: ignore[valid-type]
    """Its device's speed at the run's model, measured when it started (``inner.benchmark_device``)."""
    benchmark_flops: confloat(strict=True, ge=0.0, le=MAX_FLOPS) = 0.0  # type: ignore[valid-type]
    """The same in FLOP/s, estimated (6 x params x tokens per second)."""
    compute_s: confloat(strict=True, ge=0.0, le=float(MAX_COUNT)) = 0.0  # type: ignore[valid-type]
    """Seconds it has spent in inner phases of this run."""
    rounds_contributed: conint(strict=True, ge=0, le=MAX_COUNT) = 0  # type: ignore[valid-type]
    """Rounds of this run whose outer step it applied with its own pseudo-gradient."""
    group: conlist(constr(strict=True, min_length=1, max_length=MAX_PEER_ID), max_items=MAX_LISTED) = []  # type: ignore[valid-type]
    """While ``averaging`` with averaging.settled_groups: whom its barrier found ready in ``round``, itself
    included (sorted), published once it passed the barrier; empty before, and once its state or round
    changes (protocol.settle reads it)."""
    # A verifiable round's claims (verification.replicas > 1; verify.judge_round reads them), empty otherwise.
    numeric_class: constr(strict=True, max_length=32) = ""  # type: ignore[valid-type]
    """Where it trains: device/dtype (cpu/float32, cuda/bfloat16...). Replicas of one class agree closer."""
    shard: constr(strict=True, regex=r"^([0-9]{1,9}/[0-9]{1,9})?$") = ""  # type: ignore[valid-type]
    """The shard of ``round`` it trains, ``index/count`` of the round's assignment."""
    replicas: conlist(  # type: ignore[valid-type]
        constr(strict=True, min_length=1, max_length=MAX_PEER_ID), max_items=MAX_REPLICAS + 1
    ) = []
    """The replica group it trains that shard with, itself included (sorted)."""
    roster: conlist(constr(strict=True, min_length=1, max_length=MAX_PEER_ID), max_items=MAX_LISTED) = []  # type: ignore[valid-type]
    """The roster it computed the round's assignment over (sorted peer ids): the verdict checks every group
    against the assignment over the roster most peers name."""
    roster_classes: conlist(constr(strict=True, max_length=32), max_items=MAX_LISTED) = []  # type: ignore[valid-type]
    """The numeric class of each of ``roster`` (in its order) as it read them at its assignment: the vote on
    the roster fixes them for the round's verdict."""
    seal: constr(strict=True, regex=r"^[0-9a-f]{0,64}$") = ""  # type: ignore[valid-type]
    """verify.sealed(digest, nonce), published when its inner phase is done, before anyone reveals."""
    digest: constr(strict=True, regex=r"^[0-9a-f]{0,64}$") = ""  # type: ignore[valid-type]
    """verify.commitment to the parts it will send (the hash of ``parts``), revealed with the nonce."""
    nonce: constr(strict=True, regex=r"^[0-9a-f]{0,32}$") = ""  # type: ignore[valid-type]
    """Revealed once every groupmate has sealed: the group's sketch seed is made of its members' nonces."""
    parts: conbytes(strict=True, max_length=PART_DIGEST_BYTES * MAX_WIRE_PARTS) = b""  # type: ignore[valid-type]
    """verify.part_digest of each all-reduce part it will send, in order (``digest`` is their hash), revealed
    with the nonce: reducers check the bytes they receive against them."""
    sketch: conbytes(strict=True, max_length=4 * SKETCH_VALUES) = b""  # type: ignore[valid-type]
    """verify.sketch of the parts it will send under the group's seed, float32 little-endian."""
    verdict: constr(strict=True, regex=r"^[0-9a-f]{0,16}$") = ""  # type: ignore[valid-type]
    """verify.RoundVerdict.digest of its verdict on ``round``: published before it leaves the round, so that
    peers that judge later still read its claims (and a verdict that differs from the others' shows)."""
    ref_round: conint(strict=True, ge=-1, le=MAX_COUNT) = -1  # type: ignore[valid-type]
    """As a referee: the round of the dissenting replica group whose shard it recomputed (-1: none)."""
    ref_group: conlist(  # type: ignore[valid-type]
        constr(strict=True, min_length=1, max_length=MAX_PEER_ID), max_items=MAX_REPLICAS + 1
    ) = []
    """That group."""
    ref_sketch: conbytes(strict=True, max_length=4 * SKETCH_VALUES) = b""  # type: ignore[valid-type]
    """The sketch of its recomputation, under the group's seed."""
    # Its view of the swarm's reputation (verify.Reputation), for `p2ptrain status`: short peer ids (the last
    # 8 characters); "id:n" in struck: n strikes in the current window.
    trusted: conlist(constr(strict=True, max_length=8), max_items=MAX_LISTED) = []  # type: ignore[valid-type]
    struck: conlist(constr(strict=True, max_length=16), max_items=MAX_LISTED) = []  # type: ignore[valid-type]
    banned: conlist(constr(strict=True, max_length=8), max_items=MAX_LISTED) = []  # type: ignore[valid-type]
    reputation: constr(strict=True, regex=r"^[0-9a-f]{0,16}$") = ""  # type: ignore[valid-type]
    """verify.Reputation.digest_of the reputation it donates with the state of ``round`` (as of entering it):
    every count, those under the trust threshold included, which the lists above leave out."""

    class Config:
        extra = "forbid"

    @validator("roster_classes", always=True)  # also where the field is left out: a push leaves out defaults
    def _a_class_per_roster_member(cls, classes: list[str], values: dict[str, Any]) -> list[str]:
        if "roster" in values and len(classes) != len(values["roster"]):
            raise ValueError(f"{len(classes)} roster classes for {len(values['roster'])} roster members")
        return classes

    def wire(self) -> dict[str, Any]:
        """The record as plain msgpack-able values (the state as its string)."""
        data = self.dict()
        data["state"] = self.state.value
        return data

    @property
    def holds_params(self) -> bool:
        """Its params are a real global state of its round (not a newcomer's, not a leaver's)."""
        return self.state not in (PeerState.LOADING, PeerState.LEFT) and bool(self.params_hash)


@dataclass(frozen=True)
class Vote:
    """One peer's say in which params are canonical: its params hash, its last group's size, and whether
    others can download its params."""

    params_hash: str
    last_group_size: int
    serves: bool = True

    @classmethod
    def of(cls, record: ProgressRecord) -> Vote:
        return cls(record.params_hash, record.last_group_size, record.serves)


def live(records: Mapping[str, ProgressRecord]) -> dict[str, ProgressRecord]:
    """Records of peers that have not said they left."""
    return {pid: r for pid, r in records.items() if r.state != PeerState.LEFT}


def global_round(records: dict[str, ProgressRecord]) -> int:
    """The swarm's round: the highest round any live peer holds params of (-1: nobody does)."""
    return max((r.round for r in records.values() if r.holds_params), default=-1)


def canonical_hash(votes: Iterable[Vote]) -> str | None:
    """The params hash that peers of one round should converge on, or None if nobody reported one.

    The most common hash wins. Ties go to a hash that some holder serves (params that nobody can download,
    their holders all in client mode, are a dead end for every peer that does not hold them already), then
    to the hash whose holders averaged in the larger group last round, then to the smaller hash string, so
    that every peer that sees the same votes picks the same winner. Whether a peer serves is its own claim:
    it breaks ties only, never outvotes a majority.
    """
    votes = [v for v in votes if v.params_hash]
    counts = Counter(v.params_hash for v in votes)
    if not counts:
        return None
    best_group = {h: max(v.last_group_size for v in votes if v.params_hash == h) for h in counts}
    served = {v.params_hash for v in votes if v.serves}
    return min(counts, key=lambda h: (-counts[h], h not in served, -best_group[h], h))


def view_hash(peer_ids: Iterable[str]) -> str:
    """A short hash of a set of peer ids: equal on peers that see the same live peers."""
    return hashlib.sha256("\n".join(sorted(peer_ids)).encode()).hexdigest()[:12]


class SplitWatch:
    """Notices when this peer and others keep seeing the swarm differently.

    A peer disagrees with us when its view (the set of live peers it sees) differs from ours, or its round
    is two or more from ours (peers of one swarm are at most one round apart, except while one catches up).
    Short disagreements are normal (a peer joins or leaves and records take a few heartbeats to spread);
    :meth:`observe` reports only those that last ``after_s``, at most once per ``after_s``.
    """

    def __init__(self, after_s: float):
        self.after_s = after_s
        self._since: dict[str, float] = {}  # peer id -> when we first saw it disagree (continuously since)
        self._last_warning = -float("inf")

    def observe(
        self, now: float, me: str, my_round: int, records: dict[str, ProgressRecord]
    ) -> dict[str, Any] | None:
        """Feed one reading of the live records; returns the warning's fields when one is due."""
        mine = view_hash(records.keys() | {me})
        disagreeing = {}
        for pid, r in records.items():
            if pid == me or r.state in (PeerState.LOADING, PeerState.PAUSED):
                continue  # a round apart on purpose
            other_view = bool(r.view) and r.view != mine
            far_round = abs(r.round - my_round) >= 2 and r.state != PeerState.DONE
            if other_view or far_round:
                disagreeing[pid] = r
        self._since = {pid: self._since.get(pid, now) for pid in disagreeing}
        lasting = [pid for pid, t in self._since.items() if now - t >= self.after_s]
        if not lasting or now - self._last_warning < self.after_s:
            return None
        self._last_warning = now
        return {
            "for_s": round(max(now - self._since[pid] for pid in lasting), 1),
            "we_see": len(records.keys() | {me}),
            "our_round": my_round,
            "they_see": {pid[-8:]: disagreeing[pid].seen for pid in lasting},
            "their_rounds": {pid[-8:]: disagreeing[pid].round for pid in lasting},
        }
