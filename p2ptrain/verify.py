"""Verification by replicas: what two peers that trained the same shard from the same start must agree on.

In a verifiable round the inner optimizer starts fresh and the learning rate depends on (round, step) only,
so peers that train the same shard of the same round from the swarm's params compute nearly the same
pseudo-gradient: their relative L2 distance is at most 0.002 in float32 (different thread counts) and 0.01
to 0.21 between float32 and bfloat16, while a wrong shard, a lazy peer, poisoned data, a stale round,
zeros, a flipped sign or noise are 0.37 and more away (docs/benchmarks.md, replicas). Comparing whole
pseudo-gradients would cost a model's size in traffic per comparison; a :func:`sketch` (a CountSketch: 1024
values, linear in the pseudo-gradient) estimates their distance within a few percent.

A sketch can be fooled by a pseudo-gradient made for it (anything in the sketch's null space is
invisible), so its seed must be unknown while the pseudo-gradient is fixed. Each replica first seals a
:func:`commitment` to the exact bytes it will send into the all-reduce (a digest per part: :func:`wire`) and
a nonce; the seed is made of the group's nonces, revealed only once every member has sealed
(:func:`group_seed`), so nobody can grind it. The sketch is of those parts as their receivers decode them,
each part into buckets of its own (:func:`sketch_layout`): a reducer that receives a part checks its digest
and its buckets (:func:`sent_problem`), so a peer that sends other bytes than it sealed, or publishes a
sketch that is not of them (one copied from a replica), is refused by every reducer it sends to.

Who checks whom is :func:`assign` (replica groups from the roster and a seed: untrusted peers always
share their shard with trusted ones, trusted ones are audited at a fraction), and what verdicts add up to
is a :class:`Reputation` (trust from agreement, bans from referees' convictions).

Pure functions, no network. The trainer carries them out in a verifiable round (``verification.replicas`` >
1; ``Trainer.verify_round``): seals, nonces and sketches travel in the progress records.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch
from hivemind.compression import CompressionBase
from hivemind.proto import runtime_pb2

from p2ptrain.compression import DEFAULT_PART_SIZE_BYTES, deserialize, wire_parts
from p2ptrain.records import MAX_REPLICAS, PART_DIGEST_BYTES, SKETCH_VALUES, ProgressRecord

SKETCH_WIDTH = SKETCH_VALUES
"""Values in a sketch: the distance estimate's relative error is about sqrt(1 / width), 3% here."""


def part_digest(serialized: runtime_pb2.Tensor) -> bytes:
    """What a replica commits to for one all-reduce part: 16 bytes of sha256 over the part as it goes on the
    wire (its format, dtype, shape and bytes)."""
    digest = hashlib.sha256()
    digest.update(f"{serialized.compression}\n{serialized.dtype}\n{tuple(serialized.size)}\n".encode())
    digest.update(serialized.buffer)
    return digest.digest()[:PART_DIGEST_BYTES]


@dataclass(frozen=True)
class Wire:
    """A pseudo-gradient as the all-reduce will send it."""

    parts: list[torch.Tensor]
    """Each part as its receivers decode it (flat, float32), in hivemind's order."""
    digests: bytes
    """:func:`part_digest` of each part, in order."""


def wire(
    tensors: Sequence[torch.Tensor], codec: CompressionBase, part_size_bytes: int = DEFAULT_PART_SIZE_BYTES
) -> Wire:
    """Cut, encode and decode a pseudo-gradient exactly as the averager will (codecs are deterministic), so
    that what a replica sketches and commits to is what its reducers receive, byte for byte."""
    decoded, digests = [], []
    for part, info in wire_parts(tensors, codec, part_size_bytes):
        serialized = codec.compress(part, info, allow_inplace=False)
        digests.append(part_digest(serialized))
        decoded.append(deserialize(serialized).to(torch.float32).reshape(-1))
    return Wire(decoded, b"".join(digests))


def commitment(digests: bytes) -> str:
    """What a replica seals: the hash of its parts' digests (so the seal binds every byte it will send)."""
    return hashlib.sha256(digests).hexdigest()


def sketch_seed(run_id: str, round: int, commitments: Sequence[str]) -> int:
    """The seed of a replica group's sketches: a function of every member's commitment (in any order)."""
    text = "\n".join([run_id, str(round), *sorted(commitments)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


_SKETCH_CHUNK = 1 << 16
"""Values sketched at a time. Whole-vector temporaries (tens of MB each, at every call) grow a long-running
process's heap without bound under glibc's malloc; chunks of one size are reused."""


def sketch_layout(sizes: Sequence[int], width: int = SKETCH_WIDTH) -> list[tuple[int, int]]:
    """Which buckets of a sketch each part owns, as (offset, count): in proportion to its size (largest
    remainders), one at least, ``width`` in all. Public, like the parts' sizes."""
    if len(sizes) > width:
        raise ValueError(f"{len(sizes)} parts do not fit a sketch of {width} values")
    spare = width - len(sizes)
    quotas = [spare * n / max(sum(sizes), 1) for n in sizes]
    counts = [1 + int(q) for q in quotas]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (int(quotas[i]) - quotas[i], i))
    for k in range(width - sum(counts)):
        counts[by_remainder[k % len(sizes)]] += 1
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    return list(zip(offsets, counts))


def part_sketch(part: torch.Tensor, seed: int, index: int, width: int) -> torch.Tensor:
    """CountSketch of one part into its ``width`` buckets: value j goes, with a random sign, into a random
    bucket, both drawn from (``seed``, ``index``) in order. A reducer that holds part ``index`` computes it
    alone."""
    key = hashlib.sha256(f"{seed}\n{index}".encode()).digest()[:8]
    generator = torch.Generator().manual_seed(int.from_bytes(key, "little"))
    out = torch.zeros(width, dtype=torch.float64)
    flat = part.detach().to("cpu", torch.float32).reshape(-1)
    for start in range(0, flat.numel(), _SKETCH_CHUNK):
        piece = flat[start : start + _SKETCH_CHUNK]
        draws = torch.randint(0, 2 * width, (piece.numel(),), generator=generator, dtype=torch.int64)
        signed = torch.where((draws & 1).bool(), piece, -piece).double()
        out.index_add_(0, draws >> 1, signed)
    return out


def sketch(parts: Sequence[torch.Tensor], seed: int, width: int = SKETCH_WIDTH) -> torch.Tensor:
    """CountSketch of a pseudo-gradient's parts (:attr:`Wire.parts`), each into its own buckets
    (:func:`sketch_layout`). Linear, so sketch(a) - sketch(b) = sketch(a - b), and ||sketch(x)|| estimates
    ||x||; and a part's buckets are :func:`part_sketch` of that part alone."""
    layout = sketch_layout([p.numel() for p in parts], width)
    return torch.cat([part_sketch(p, seed, i, count) for i, (p, (_, count)) in enumerate(zip(parts, layout))])


@dataclass(frozen=True)
class Sealed:
    """What a counted peer of a verifiable round committed to about the parts it sends: every reducer
    checks the parts it receives from it against this (:func:`sent_problem`)."""

    digests: bytes
    sketch: bytes = b""
    """Its published sketch (float32), b"" if it published none (a trusted peer whose partner vanished)."""
    seed: int | None = None
    """Its sketch's seed, None if it published none."""


def sent_problem(
    sealed: Sealed, index: int, digest: bytes, part: torch.Tensor, layout: Sequence[tuple[int, int]]
) -> str | None:
    """What is wrong with part ``index`` as a sender sent it (its :func:`part_digest` and decoded values),
    against what it sealed and sketched; None if nothing is.

    The digest shows bytes other than the sealed ones (fixed before the sketch's seed was known, so they
    cannot have been made for the sketch). The part's buckets show a sketch that is not of these bytes (one
    copied from a replica, say), so the sketch the replicas compared is of what is sent. Both are exact: the
    sender computed them from the same bytes.
    """
    expected = sealed.digests[index * PART_DIGEST_BYTES : (index + 1) * PART_DIGEST_BYTES]
    if digest != expected:
        return f"part {index} is not the one it sealed"
    if sealed.seed is None or not sealed.sketch or index >= len(layout):
        return None
    offset, count = layout[index]
    published = torch.frombuffer(
        bytearray(sealed.sketch[4 * offset : 4 * (offset + count)]), dtype=torch.float32
    )
    if published.numel() != count:
        return f"its sketch has no buckets for part {index}"
    mine = part_sketch(part, sealed.seed, index, count).float()
    if not distance(mine.double(), published.double()) <= SENT_SKETCH_TOLERANCE:
        return f"its sketch is not of part {index} as sent"
    return None


SENT_SKETCH_TOLERANCE = 1e-5
"""A part's buckets as sent against as published: equal but for float rounding (both are float32 of the same
float64 sums of the same values)."""


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative distance of two sketches (or two flat pseudo-gradients): ||a - b|| / max(||a||, ||b||)."""
    scale = max(float(a.norm()), float(b.norm()))
    if scale == 0.0:
        return 0.0
    return float((a - b).norm()) / scale


@dataclass(frozen=True)
class Report:
    """What a replica says about its pseudo-gradient of a round, once the group's seed is known."""

    peer: str
    numeric_class: str
    """Where it trained: ``device/dtype`` (``cpu/float32``, ``cuda/bfloat16``...). Replicas of different
    classes agree less closely."""
    sketch: torch.Tensor
    norm: float


Tolerances = Mapping[tuple[str, str], float]
"""Largest honest distance per pair of numeric classes (in sorted order); see :func:`tolerance`."""

DEFAULT_TOLERANCE = 0.02
"""Between two replicas of the same numeric class (float32 on CPUs: 0.0017 at most, measured)."""
MIXED_PRECISION_TOLERANCE = 0.15
"""Between replicas of different classes, before calibration (float32 vs bfloat16 measured 0.01 to 0.21,
depending on the round: :func:`calibrate` raises it as far as :data:`MAX_TOLERANCE`)."""
MAX_TOLERANCE = 0.25
"""No calibration may raise a tolerance above this: the nearest attack measured (poisoned data) is 0.37."""


def class_pair(a: str, b: str) -> tuple[str, str]:
    """The key of two numeric classes in :data:`Tolerances`: in sorted order."""
    return (min(a, b), max(a, b))


def tolerance(a: str, b: str, tolerances: Tolerances | None = None) -> float:
    """The largest distance at which replicas of classes ``a`` and ``b`` still agree."""
    key = class_pair(a, b)
    if tolerances is not None and key in tolerances:  # not `if tolerances`: a ByClass has no length
        return min(tolerances[key], MAX_TOLERANCE)
    if a == b:
        return DEFAULT_TOLERANCE
    return MIXED_PRECISION_TOLERANCE


class ByClass(Mapping):
    """:data:`Tolerances` from two numbers: ``same`` for replicas of one numeric class, ``mixed`` otherwise
    (the ``verification.tolerance`` and ``verification.mixed_tolerance`` settings)."""

    def __init__(self, same: float, mixed: float):
        self.same, self.mixed = same, mixed

    def __getitem__(self, key: tuple[str, str]) -> float:
        return self.same if key[0] == key[1] else self.mixed

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 2

    def __iter__(self):
        return iter(())

    def __len__(self) -> int:
        return 0


CALIBRATION_MARGIN = 1.5
"""A calibrated tolerance is this many times the largest honest distance seen."""


def calibrate(honest: Sequence[float], *, floor: float, margin: float = CALIBRATION_MARGIN) -> float:
    """A tolerance from the distances of replicas that agreed in earlier rounds (the grace rounds first,
    then a window of recent rounds): ``margin`` times the largest, never below ``floor`` (the class pair's
    default: two replicas that happened to agree exactly must not make the next round's tolerance zero),
    never above :data:`MAX_TOLERANCE` (what a calibration can hide stays bounded)."""
    return min(max(floor, margin * max(honest, default=0.0)), MAX_TOLERANCE)


class Outcome(str, Enum):
    AGREE = "agree"
    """Every pair of replicas agrees: the group's pseudo-gradient counts once."""
    DISSENT = "dissent"
    """Some pair does not: the whole group is left out of the average, and a referee recomputes the shard."""


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    distances: dict[tuple[str, str], float]
    """Every pair's distance, by (peer, peer) in sorted order."""


def judge(reports: Sequence[Report], tolerances: Tolerances | None = None) -> Verdict:
    """The verdict on one replica group: a pure function of its reports, so every honest peer reaches it.

    The group agrees only if every pair agrees and every norm is finite. There is no majority vote: in a
    group of three with one dissenter, the group is left out and the referee decides (two colluders that
    send the same wrong pseudo-gradient must not outvote, and so frame, an honest peer).
    """
    distances: dict[tuple[str, str], float] = {}
    agree = all(math.isfinite(r.norm) and bool(torch.isfinite(r.sketch).all()) for r in reports)
    ordered = sorted(reports, key=lambda r: r.peer)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            d = distance(a.sketch, b.sketch)
            distances[(a.peer, b.peer)] = d
            if not d <= tolerance(a.numeric_class, b.numeric_class, tolerances):
                agree = False
    return Verdict(Outcome.AGREE if agree else Outcome.DISSENT, distances)


def refereed(reports: Sequence[Report], referee: Report, tolerances: Tolerances | None = None) -> set[str]:
    """The replicas that a referee's recomputation of the same shard convicts: those that do not agree with it.

    A referee is a third peer, drawn after the dissent, that trains the shard from the same start. If it
    agrees with nobody, nobody is convicted (it may be the broken one): the group stays left out.
    """
    far = {
        r.peer
        for r in reports
        if not distance(r.sketch, referee.sketch)
        <= tolerance(r.numeric_class, referee.numeric_class, tolerances)
    }
    if far == {r.peer for r in reports}:
        return set()
    return far


# ---------------------------------------------------------------------------------------- who checks whom


@dataclass(frozen=True)
class Member:
    """A peer of a verifiable round, as the assignment sees it."""

    peer: str
    numeric_class: str
    trusted: bool


Roster = tuple[tuple[str, str], ...]
"""A round's roster as its claims name it: (peer, numeric class) of each member, sorted by peer."""


@dataclass(frozen=True)
class Assignment:
    groups: tuple[tuple[str, ...], ...]
    """The replica groups, one per shard: shard i is trained by every peer of ``groups[i]``."""

    def shard_of(self, peer: str) -> int | None:
        return next((i for i, group in enumerate(self.groups) if peer in group), None)

    @property
    def shards(self) -> int:
        return len(self.groups)


def assign(members: Sequence[Member], seed: int, *, replicas: int, audit_fraction: float) -> Assignment:
    """Who trains which shard in a verifiable round: a pure function of the roster and a seed that no single
    peer controls (the caller derives it from the round and the swarm's params).

    * An untrusted peer always shares its shard with ``replicas - 1`` others, trusted ones first, of its own
      numeric class where possible; with nobody to share with yet, it joins an existing group.
    * A trusted peer is audited with probability ``audit_fraction``: audited ones are grouped among
      themselves, or with a trusted peer that would have trained alone; the others train a shard alone
      (replication costs only where trust is missing: about ``audit_fraction`` of the work is duplicated).
    """
    if replicas < 1 or not 0.0 <= audit_fraction <= 1.0:
        raise ValueError(f"replicas {replicas} must be >= 1 and audit_fraction {audit_fraction} in [0, 1]")
    rng = random.Random(seed)
    ordered = sorted(members, key=lambda m: m.peer)
    rng.shuffle(ordered)
    if replicas == 1:
        return Assignment(tuple((m.peer,) for m in sorted(ordered, key=lambda m: m.peer)))
    untrusted = [m for m in ordered if not m.trusted]
    audited = [m for m in ordered if m.trusted and rng.random() < audit_fraction]
    alone = [m for m in ordered if m.trusted and m not in audited]
    groups: list[list[Member]] = []

    def take(pool: list[Member], like: Member) -> Member | None:
        same = [m for m in pool if m.numeric_class == like.numeric_class]
        if not (same or pool):
            return None
        chosen = (same or pool)[0]
        pool.remove(chosen)
        return chosen

    def group_of(first: Member, pools: list[list[Member]]) -> list[Member]:
        group = [first]
        for pool in pools:
            while len(group) < replicas and (partner := take(pool, first)) is not None:
                group.append(partner)
        return group

    # Untrusted peers first, each with trusted partners taken from those that would have trained alone (an
    # audit for them too), then from the audited, then with other untrusted peers.
    while untrusted:
        groups.append(group_of(untrusted.pop(0), [alone, audited, untrusted]))
    while (
        audited
    ):  # with each other, else with one that would have trained alone: audits form in small swarms
        groups.append(group_of(audited.pop(0), [audited, alone]))
    # Groups left short (nobody to share with): a lone untrusted or audited peer joins a group of its class.
    short = [g for g in groups if len(g) == 1]
    for g in short:
        hosts = [h for h in groups if len(h) > 1]
        if hosts:
            groups.remove(g)
            host = next((h for h in hosts if h[0].numeric_class == g[0].numeric_class), hosts[0])
            host.append(g[0])
    groups += [[m] for m in alone]
    return Assignment(tuple(sorted(tuple(sorted(m.peer for m in g)) for g in groups)))


@dataclass
class Reputation:
    """Trust and bans, from verdicts: a pure record, the same on every peer that saw the same verdicts.

    A peer becomes trusted after ``rounds_to_trust`` verified rounds in agreement, and loses that trust
    with any strike. A strike is a conviction by a referee (never a dissent alone); ``strikes_to_ban``
    strikes within ``window`` rounds ban the peer for the rest of the run. A new identity starts untrusted,
    so a banned peer gains nothing by coming back under another one.
    """

    rounds_to_trust: int = 8
    strikes_to_ban: int = 2
    window: int = 64
    agreed: dict[str, int] = field(default_factory=dict)
    strikes: dict[str, list[int]] = field(default_factory=dict)
    banned: set[str] = field(default_factory=set)

    def agree(self, peers: Sequence[str]) -> None:
        for peer in peers:
            self.agreed[peer] = self.agreed.get(peer, 0) + 1

    def convict(self, peers: Sequence[str], round: int) -> set[str]:
        """Strike each of ``peers`` for ``round``; returns those banned now."""
        newly = set()
        for peer in peers:
            recent = [r for r in self.strikes.get(peer, []) if r > round - self.window] + [round]
            self.strikes[peer] = recent
            self.agreed[peer] = 0
            if len(recent) >= self.strikes_to_ban and peer not in self.banned:
                self.banned.add(peer)
                newly.add(peer)
        return newly

    def trusted(self, peer: str) -> bool:
        return peer not in self.banned and self.agreed.get(peer, 0) >= self.rounds_to_trust

    def listed(self, limit: int) -> dict[str, list[str]]:
        """This reputation as a progress record lists it (short ids, at most ``limit`` of each)."""
        trusted = sorted(p[-8:] for p in self.agreed if self.trusted(p))
        struck = sorted(f"{p[-8:]}:{len(r)}" for p, r in self.strikes.items() if r)
        return {
            "trusted": trusted[:limit],
            "struck": struck[:limit],
            "banned": sorted(p[-8:] for p in self.banned)[:limit],
        }

    MAX_PEERS = 4096
    """The most peers a saved reputation may name (it travels in the state that newcomers download)."""

    @staticmethod
    def digest_of(saved: Mapping) -> str:
        """A short hash of a reputation's :meth:`to_dict`, every count in it: what a progress record carries
        of the reputation its peer donates, for newcomers to compare the one they download with."""
        text = json.dumps(saved, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return {
            "agreed": dict(self.agreed),
            "strikes": {p: list(r) for p, r in self.strikes.items()},
            "banned": sorted(self.banned),
        }

    def restore(self, saved: object) -> None:
        """Take over a saved reputation (a checkpoint's, or a donor's state's); a malformed one is ignored
        whole: it came from a file or a stranger."""
        if not isinstance(saved, Mapping):
            return
        agreed, strikes, banned = saved.get("agreed"), saved.get("strikes"), saved.get("banned")
        ok = (
            isinstance(agreed, Mapping)
            and isinstance(strikes, Mapping)
            and isinstance(banned, list)
            and max(len(agreed), len(strikes), len(banned)) <= self.MAX_PEERS
            and all(isinstance(p, str) and type(n) is int and n >= 0 for p, n in agreed.items())
            and all(
                isinstance(p, str) and isinstance(r, list) and len(r) <= 64 and all(type(x) is int for x in r)
                for p, r in strikes.items()
            )
            and all(isinstance(p, str) for p in banned)
        )
        if not ok:
            return
        assert isinstance(agreed, Mapping) and isinstance(strikes, Mapping) and isinstance(banned, list)
        self.agreed = dict(agreed)
        self.strikes = {p: list(r) for p, r in strikes.items()}
        self.banned = set(banned)


def swarm_reputation(mine: str, trusted_digests: Sequence[str], *, trusted_self: bool) -> str | None:
    """The reputation digest to take instead of ours (``mine``; empty: ours is not backed by the swarm), or
    None: where more than half of the trusted peers of our round (``trusted_digests``, each the digest its
    record carries, empty where it carries none; with ours too where we are ``trusted_self``) carry one
    digest, and it is not ours, and at least :data:`MIN_REALIGN_VOUCHERS` of them do.

    Peers that read different claims of a round (a key holder showed each another record) reach different
    verdicts, and count agreement and strikes differently from then on: this puts a drifted peer back on the
    swarm's reputation a round later. Only trusted peers have a say: any number of new identities must not
    hand anyone a reputation; where the trusted are split evenly, nobody moves.
    """
    votes = Counter(d for d in trusted_digests if d)
    if not votes:
        return None
    voters = len(trusted_digests) + trusted_self  # a trusted peer that carries no digest counts against all
    digest, count = votes.most_common(1)[0]
    if count < MIN_REALIGN_VOUCHERS or count * 2 <= voters or digest == mine:
        return None
    return digest


MIN_REALIGN_VOUCHERS = 2
"""The fewest trusted peers (us not included) that must carry a reputation digest for a drifted peer to take
it: one trusted key holder alone never hands anyone a reputation."""


# ------------------------------------------------------------------------------- a verifiable round


def assignment_seed(run_id: str, round: int, params_hash: str) -> int:
    """The seed of a round's :func:`assign`: from the round's params, which no single peer chose."""
    text = f"{run_id}\nassign\n{round}\n{params_hash}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def sealed(digest: str, nonce: str) -> str:
    """What a replica publishes before anyone reveals: it binds its pseudo-gradient's :func:`commitment` and
    a nonce. The nonce, revealed once every groupmate has sealed, seeds the group's sketches; since it was
    fixed by the seal, the last replica to reveal cannot grind the seed."""
    return hashlib.sha256(f"{digest}\n{nonce}".encode()).hexdigest()


def group_seed(run_id: str, round: int, nonces: Sequence[str]) -> int:
    """The seed of a replica group's sketches: every member's revealed nonce (in any order)."""
    return sketch_seed(run_id, round, [f"nonce:{n}" for n in nonces])


@dataclass(frozen=True)
class Claim:
    """What one peer of a verifiable round published about its work (its progress record's fields)."""

    peer: str
    numeric_class: str
    shard: str
    """Which shard it trained, ``index/count`` of the round's assignment."""
    replicas: tuple[str, ...]
    """The replica group it trained the shard with (itself included), as its assignment said."""
    seal: str = ""
    digest: str = ""
    nonce: str = ""
    sketch: torch.Tensor | None = None
    parts: bytes = b""
    """The digests of the parts it sends (:attr:`Wire.digests`): ``digest`` is their hash."""
    roster: Roster = ()
    """The roster it computed the round's assignment over: each member and its numeric class as the peer read
    them then, sorted by peer."""

    @classmethod
    def of(cls, record: ProgressRecord) -> Claim:
        """A peer's claim as its record states it (a sketch of the wrong size reads as none)."""
        raw = record.sketch
        sketch = None
        if len(raw) == 4 * SKETCH_WIDTH:
            sketch = torch.frombuffer(bytearray(raw), dtype=torch.float32).double()
        return cls(
            record.peer_id,
            record.numeric_class,
            record.shard,
            tuple(record.replicas),
            seal=record.seal,
            digest=record.digest,
            nonce=record.nonce,
            sketch=sketch,
            parts=record.parts,
            roster=tuple(zip(record.roster, record.roster_classes)),  # the schema makes them alike in length
        )

    def report(self, classes: Mapping[str, str] | None = None) -> Report:
        """Its sketch as a :class:`Report` (only for a claim that has one), of the numeric class ``classes``
        gives it (the round's roster's: :attr:`RoundVerdict.classes`), else of the one it claims."""
        if self.sketch is None:
            raise ValueError(f"{self.peer} published no sketch")
        numeric_class = (classes or {}).get(self.peer, self.numeric_class)
        return Report(self.peer, numeric_class, self.sketch, float(self.sketch.norm()))

    @property
    def revealed(self) -> bool:
        """Its nonce opens its seal, and its parts' digests are what it sealed."""
        return (
            bool(self.nonce and self.digest)
            and sealed(self.digest, self.nonce) == self.seal
            and commitment(self.parts) == self.digest
        )


class Why(str, Enum):
    """Why a peer of a verifiable round is left out of its average."""

    BANNED = "banned"
    DISSENT = "dissent"
    """Its replica group disagrees: the whole group is left out (and a referee decides who was wrong)."""
    UNMATCHED = "unmatched"
    """Untrusted, and no complete replica group backs it (a groupmate claimed another group or shard, or
    left)."""
    UNREVEALED = "unrevealed"
    """Its group did not reveal (a nonce that does not open its seal, or no sketch) in time."""
    MISASSIGNED = "misassigned"
    """Its group or shard is not what the round's assignment gives it (a peer does not choose its partners),
    or it claims to have trained alone when the assignment drew it for an audit."""


@dataclass(frozen=True)
class RoundVerdict:
    """Who counts in a verifiable round's average, and with what share of its weight."""

    shares: dict[str, float]
    """Peer -> the factor of its weight: 1 / its replica group's size (a shard counts once), 1 alone."""
    left_out: dict[str, Why]
    agreed: tuple[tuple[str, ...], ...]
    """Replica groups (of two or more) that agree."""
    dissent: tuple[tuple[str, ...], ...]
    distances: dict[tuple[str, str], float]
    classes: dict[str, str] = field(default_factory=dict)
    """The numeric class each peer of the round's roster was judged as: the roster's, as the peers that named
    it read it at their assignment (never the class a claim states as the verdict reads it, which its peer
    could change between two honest peers' reads)."""

    def digest(self) -> str:
        """A short hash of who counts with what share and who is left out why: equal on peers that agree."""
        text = repr((sorted(self.shares.items()), sorted((p, w.value) for p, w in self.left_out.items())))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def consensus_roster(claims: Sequence[Claim], trusted: Callable[[str], bool]) -> Roster | None:
    """The roster a round's assignment was computed over, as its claims name it, each member with its numeric
    class: the one named by the most trusted claimants (by all claimants while none is trusted: new
    identities cannot outvote trusted peers, however many they are); a tie goes to the smallest. None if no
    claim names one.

    The classes are part of what is voted on: the assignment pairs replicas by class and the verdict's
    tolerances depend on it, so they are fixed by the vote, never read from a member's record at the verdict
    (a peer that changed its class between two honest peers' reads would otherwise give them different
    assignments and different verdicts)."""
    voters = [c for c in claims if c.roster and trusted(c.peer)] or [c for c in claims if c.roster]
    if not voters:
        return None
    counts = Counter(tuple(c.roster) for c in voters)
    most = max(counts.values())
    return min(r for r, n in counts.items() if n == most)


def _shard_index(shard: str) -> tuple[int, int] | None:
    index, _, count = shard.partition("/")
    if not (index.isascii() and index.isdigit() and count.isascii() and count.isdigit()):
        return None
    return int(index), int(count)


def judge_round(
    claims: Sequence[Claim],
    *,
    run_id: str,
    round: int,
    trusted: Callable[[str], bool],
    banned: Callable[[str], bool] = lambda peer: False,
    tolerances: Tolerances | None = None,
    plan: Callable[[Roster], Assignment] | None = None,
) -> RoundVerdict:
    """The verdict on a verifiable round: a pure function of its claims, so every honest peer reaches it.

    A replica group counts when every member claims the same group and shard, every member's nonce opens
    its seal, every sketch is there and :func:`judge` agrees. A peer that claims to have trained alone counts
    only if it is trusted (:func:`assign` never leaves an untrusted peer alone while it has anyone to share
    with).

    With ``plan`` (the round's :func:`assign` over a roster), claims are also checked against the assignment
    over the roster the claims name (:func:`consensus_roster`): a group counts only if it is the group the
    assignment gives its shard, and a trusted peer in an incomplete group only if it claims its assigned
    group, or to have trained alone where the assignment left it alone or its partners left without a
    claim. Peers do not choose their partners, nor dodge an audit. Replicas are then compared as of the
    numeric classes that roster gives them, not the ones their claims state.
    """
    by_peer = {c.peer: c for c in claims}
    roster = consensus_roster(claims, trusted) if plan is not None else None
    expected = plan(roster) if plan is not None and roster is not None else None
    classes = dict(roster or ())

    def assigned(group: tuple[str, ...], shard: str) -> bool:
        if expected is None:  # no plan, or no claim names a roster (a round of more than MAX_LISTED peers)
            return True
        index = _shard_index(shard)
        if index is None or index[1] != expected.shards or index[0] >= expected.shards:
            return False
        return expected.groups[index[0]] == group

    def may_count_alone(claim: Claim) -> bool:
        """A trusted peer whose group is incomplete: it claims what it was assigned (a partner claimed
        otherwise, or left), or to have trained alone where it was assigned to, or where its partners left
        without claiming anything."""
        if expected is None or assigned(tuple(sorted({*claim.replicas, claim.peer})), claim.shard):
            return True
        index = expected.shard_of(claim.peer)
        if index is None or not assigned(expected.groups[index], claim.shard):
            return False
        return all(p not in by_peer for p in expected.groups[index] if p != claim.peer)

    shares: dict[str, float] = {}
    left_out: dict[str, Why] = {}
    agreed: list[tuple[str, ...]] = []
    dissent: list[tuple[str, ...]] = []
    distances: dict[tuple[str, str], float] = {}
    for claim in sorted(claims, key=lambda c: c.peer):
        peer = claim.peer
        if peer in shares or peer in left_out:
            continue
        if banned(peer):
            left_out[peer] = Why.BANNED
            continue
        group = tuple(sorted(set(claim.replicas) | {peer}))
        members = [by_peer.get(p) for p in group]
        complete = len(group) > 1 and all(
            m is not None and m.shard == claim.shard and tuple(sorted(m.replicas)) == group for m in members
        )
        if not complete:
            if not trusted(peer):
                left_out[peer] = Why.UNMATCHED
            elif not claim.revealed:  # reducers could not check what it sends
                left_out[peer] = Why.UNREVEALED
            elif not may_count_alone(claim):
                left_out[peer] = Why.MISASSIGNED
            else:
                shares[peer] = 1.0  # trained alone (or its partner vanished): its trust vouches for it
            continue
        if not assigned(group, claim.shard):
            for p in group:
                left_out[p] = Why.MISASSIGNED
            continue
        mates = [m for m in members if m is not None]
        if any(banned(m.peer) for m in mates):
            for m in mates:
                left_out.setdefault(m.peer, Why.BANNED if banned(m.peer) else Why.DISSENT)
            dissent.append(group)
            continue
        if not all(m.revealed and m.sketch is not None for m in mates):
            for m in mates:
                left_out[m.peer] = Why.UNREVEALED
            continue
        reports = [m.report(classes) for m in mates]
        verdict = judge(reports, tolerances)
        distances.update(verdict.distances)
        if verdict.outcome == Outcome.AGREE:
            agreed.append(group)
            for m in mates:
                shares[m.peer] = 1.0 / len(group)
        else:
            dissent.append(group)
            for m in mates:
                left_out[m.peer] = Why.DISSENT
    return RoundVerdict(shares, left_out, tuple(agreed), tuple(dissent), distances, classes)


def sealed_parts(
    verdict: RoundVerdict, claims: Sequence[Claim], *, run_id: str, round: int
) -> dict[str, Sealed]:
    """What reducers check each peer that counts in ``verdict`` against: its parts' digests, and its sketch
    with the seed it was drawn from (a group's that agreed: all its nonces; a peer alone: its own). A trusted
    peer whose partner vanished sketched under a seed we cannot know: only its digests are checked."""
    by_peer = {c.peer: c for c in claims}
    in_group = {p: g for g in verdict.agreed for p in g}
    out: dict[str, Sealed] = {}
    for peer in verdict.shares:
        claim = by_peer.get(peer)
        if claim is None:
            continue
        group = in_group.get(peer, (peer,) if tuple(claim.replicas) in ((), (peer,)) else None)
        if group is None or claim.sketch is None or not all(p in by_peer for p in group):
            out[peer] = Sealed(claim.parts)
            continue
        seed = group_seed(run_id, round, [by_peer[p].nonce for p in group])
        out[peer] = Sealed(claim.parts, claim.sketch.float().numpy().tobytes(), seed)
    return out


# ------------------------------------------------------------------------------------------- referees


@dataclass(frozen=True)
class Dispute:
    """A replica group that dissented in ``round``: its reports, and who recomputes its shard."""

    round: int
    group: tuple[str, ...]
    shard: str
    seed: int
    """The group's sketch seed: the referee sketches its recomputation with it."""
    referee: str
    reports: tuple[Report, ...]
    referee_class: str = ""
    """The referee's numeric class as the round's roster vote gave it (its report is compared with the
    group's under that class, never the one its record states when a peer settles the dispute); empty
    where no roster was voted (the class its record states then)."""

    MAX_PER_ROUND = 16
    """The most disputes of one round that are settled (the first in the verdict's order): every peer keeps
    the same ones, and they travel with a donated state within :data:`MAX_DONATED_DISPUTE_BYTES`."""

    def to_dict(self) -> dict:
        """What a donor passes on of a dispute it has yet to settle: a newcomer that loads the next round's
        state settles it at that round's verdict, as the swarm does. Sketches are float32 on the wire."""
        return {
            "round": self.round,
            "group": list(self.group),
            "shard": self.shard,
            "seed": self.seed,
            "referee": self.referee,
            "referee_class": self.referee_class,
            "reports": [
                {
                    "peer": r.peer,
                    "numeric_class": r.numeric_class,
                    "sketch": r.sketch.float().numpy().tobytes().hex(),
                }
                for r in self.reports
            ],
        }

    @classmethod
    def pending_of(cls, saved: object) -> list[Dispute]:
        """The disputes a saved reputation passes on (its ``disputes``); none where it has none, and none
        at all where any is malformed: it came from a file or a stranger, and is taken whole or not at all."""
        if not isinstance(saved, Mapping) or "disputes" not in saved:
            return []
        items = saved["disputes"]
        if not isinstance(items, list) or len(items) > cls.MAX_PER_ROUND:
            return []

        def text(value: object) -> bool:
            return isinstance(value, str) and len(value) <= _MAX_TEXT

        found = []
        for d in items:
            ok = (
                isinstance(d, Mapping)
                and type(d.get("round")) is int
                and d["round"] >= 0
                and isinstance(d.get("group"), list)
                and 0 < len(d["group"]) <= MAX_REPLICAS + 1  # assign may add one lone peer to a group
                and all(text(p) for p in d["group"])
                and text(d.get("shard"))
                and type(d.get("seed")) is int
                and text(d.get("referee"))
                and text(d.get("referee_class", ""))
                and isinstance(d.get("reports"), list)
                and len(d["reports"]) == len(d["group"])
                and all(
                    isinstance(r, Mapping)
                    and text(r.get("peer"))
                    and text(r.get("numeric_class"))
                    and isinstance(r.get("sketch"), str)
                    and _SKETCH_HEX.fullmatch(r["sketch"]) is not None  # bytes.fromhex would skip spaces
                    for r in d["reports"]
                )
            )
            if not ok:
                return []
            reports = []
            for r in d["reports"]:
                raw = bytearray(bytes.fromhex(r["sketch"]))
                sketch = torch.frombuffer(raw, dtype=torch.float32).double()
                reports.append(Report(r["peer"], r["numeric_class"], sketch, float(sketch.norm())))
            found.append(
                cls(
                    d["round"],
                    tuple(d["group"]),
                    d["shard"],
                    d["seed"],
                    d["referee"],
                    tuple(reports),
                    d.get("referee_class", ""),
                )
            )
        return found


_MAX_TEXT = 128
"""The longest peer id, shard or numeric class a donated dispute may name."""
_SKETCH_HEX = re.compile(f"[0-9a-f]{{{8 * SKETCH_WIDTH}}}")
"""A sketch as a donated dispute carries it: its float32 bytes in lowercase hex, nothing else."""

MAX_DONATED_DISPUTE_BYTES = Dispute.MAX_PER_ROUND * (MAX_REPLICAS + 1) * (8 * SKETCH_WIDTH + 5 * _MAX_TEXT)
"""What the pending disputes may add to a donated state's metadata, at most (about 0.6 MB)."""


def donated(reputation: Reputation, disputes: Sequence[Dispute]) -> dict:
    """The reputation a peer donates with its round's state and saves in its checkpoints: every count, and
    the disputes of the round before, which that round's verdict settles. Its digest
    (:meth:`Reputation.digest_of`) is what the peer's record carries, so the swarm vouches for both."""
    saved = reputation.to_dict()
    if disputes:  # left out where there are none: such a digest is what it was before disputes travelled
        saved["disputes"] = [d.to_dict() for d in disputes]
    return saved


def referee_for(
    group: Sequence[str],
    candidates: Sequence[str],
    *,
    run_id: str,
    round: int,
    trusted: Callable[[str], bool],
) -> str | None:
    """Who recomputes a dissenting group's shard: one of ``candidates`` (the peers that counted in the round,
    so they hold its params), trusted ones first, drawn by a hash of the round and the group; the same on
    every peer that reached the same verdict. None if nobody outside the group counted."""
    pool = sorted(set(candidates) - set(group))
    if not pool:
        return None

    def draw(peer: str) -> tuple[bool, bytes]:
        text = f"{run_id}\nreferee\n{round}\n{','.join(sorted(group))}\n{peer}"
        return (not trusted(peer), hashlib.sha256(text.encode()).digest())

    return min(pool, key=draw)


def disputes(
    verdict: RoundVerdict, claims: Sequence[Claim], *, run_id: str, round: int, trusted: Callable[[str], bool]
) -> list[Dispute]:
    """The round's dissenting groups that a referee can settle (every member revealed and sketched), at most
    :attr:`Dispute.MAX_PER_ROUND` of them."""
    by_peer = {c.peer: c for c in claims}
    found = []
    for group in verdict.dissent:
        if any(verdict.left_out.get(p) == Why.BANNED for p in group):
            continue  # a banned member took it down: nothing to settle
        found_members = [by_peer.get(p) for p in group]
        members = [m for m in found_members if m is not None and m.revealed and m.sketch is not None]
        if len(members) != len(group):
            continue
        referee = referee_for(group, list(verdict.shares), run_id=run_id, round=round, trusted=trusted)
        if referee is None:
            continue
        reports = tuple(m.report(verdict.classes) for m in members)
        seed = group_seed(run_id, round, [m.nonce for m in members])
        referee_class = verdict.classes.get(referee, "")
        found.append(Dispute(round, tuple(group), members[0].shard, seed, referee, reports, referee_class))
        if len(found) == Dispute.MAX_PER_ROUND:
            break  # the rest go unsettled, alike on every peer
    return found


def parse_shard(shard: str, num_windows: int) -> tuple[int, int] | None:
    """``index/count`` as claimed by a peer, if it names a shard that exists."""
    index, sep, count = shard.partition("/")
    if not (sep and index.isascii() and index.isdigit() and count.isascii() and count.isdigit()):
        return None
    i, n = int(index), int(count)
    return (i, n) if 0 <= i < n <= num_windows else None
