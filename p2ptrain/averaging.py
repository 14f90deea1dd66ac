"""Pseudo-gradient averaging over hivemind's decentralized all-reduce.

Changes to hivemind 1.1.12's averager, each for a reason:

* **Exact results.** hivemind's reducers send every groupmate ``average - its_own_part`` and each
  peer adds that delta to its own part. In floating point ``x + (a - x) != a``, so groupmates end
  up with params that differ in the last bits and drift apart round after round. Our reducers
  serialize the averaged part once and send the same bytes to everyone, themselves included: all
  members of a group hold bit-identical averages, with or without lossy compression.
* **No partial results.** When a reducer leaves mid-way, hivemind quietly keeps the peer's own
  values for that reducer's slice. We fail the all-reduce instead; the caller decides what to do
  (retry, or apply its own pseudo-gradient) with its own copy, never with a half-averaged one.
* **One group per round.** The round number is the matchmaking key's group bits, so peers of
  different rounds can never be matched.
* **Nothing a groupmate sends is trusted.** A reducer takes a part only if it decodes to exactly the
  expected shape, is float32 and finite, and comes with a weight in (0, ``max_weight``]; a reducer's
  answer is checked the same way. A groupmate that sends anything else, or stalls for a whole timeout, is
  left out (:class:`LeftOut`): the reducers average without it, and the retry of the round neither joins
  its group nor lets it join ours. Only members of the run may call the averager at all (``_admit``).
* **Groups the barrier names.** The barrier already knows who is in the round, so the first attempt of a
  round's all-reduce skips hivemind's search of the DHT for a leader (every member polls the matchmaking key,
  each poll answered with every member's declaration): every member asks the round's leader
  (:func:`barrier_leader`: of those not in client mode, the id that hashes lowest with the round) to lead
  it, and that leader starts once all have joined (:class:`BarrierLeaders`). A follower that leader refuses
  for good (its group is full, or it follows another) gives the named search up at once, so that its retry,
  which searches as hivemind does, meets the retries of the others the leader left without a group.
* **Robust reducers.** A part that passes those checks may still be wrong (ten times a pseudo-gradient,
  sign flipped). Reducers combine parts with ``averaging.aggregator`` (CenteredClip by default,
  ``aggregation.py``) instead of hivemind's running weighted sum (:class:`RobustPartReducer`).

It also counts the payload bytes each peer sends and receives, and lets the trainer download the
swarm's state from a donor of its choosing (the checks on what arrives are in ``transfer.py``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hashlib
import math
import os
import pickle
import threading
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException, PotentialLeaders
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from hivemind.compression.serialization import combine_from_streaming
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_dht_time
from hivemind.utils.asyncio import (
    achain,
    aiter_with_timeout,
    amap_in_executor,
    as_aiter,
    attach_event_on_finished,
    azip,
)

from p2ptrain.aggregation import Aggregate, aggregator, mean
from p2ptrain.compression import Layout, deserialize
from p2ptrain.config import AveragingConfig
from p2ptrain.diloco import AverageResult, AveragingFailed
from p2ptrain.logs import bind, get_logger, unbind
from p2ptrain.membership import Throttle
from p2ptrain.procs import ParentWatchdog, WholeMessages, keep_sigint_handler
from p2ptrain.verify import MAX_DONATED_DISPUTE_BYTES, Sealed, part_digest, sent_problem, sketch_layout

log = get_logger(__name__)

_POLL_S = 0.25
MAX_MESSAGE_BYTES = 16 * 2**20
"""The largest message read from another peer's stream: hivemind reads whatever length a sender announces,
before any handler (or ``_admit``) sees the caller, so anyone who can reach a peer could make it buffer
gigabytes. An averaging message is one part (hivemind's 512 KiB), a 64 KiB piece of a state, or a request."""
_oversized = Throttle()


async def _receive_bounded(reader: asyncio.StreamReader) -> bytes:
    """``P2P.receive_raw_data`` with :data:`MAX_MESSAGE_BYTES`: a longer message ends the stream unread, as
    a closed connection does (each side then gives up on that call)."""
    header = await reader.readexactly(P2P.HEADER_LEN)
    length = int.from_bytes(header, P2P.BYTEORDER)
    if length > MAX_MESSAGE_BYTES:
        if times := _oversized.due():
            log.warning("refused an oversized message", bytes=length, limit=MAX_MESSAGE_BYTES, times=times)
        raise asyncio.IncompleteReadError(b"", length)
    return await reader.readexactly(length)


# Every stream message of this process and of the processes it forks (the averager, the DHT) goes through it.
P2P.receive_raw_data = staticmethod(_receive_bounded)  # type: ignore[method-assign]
_GRACE_S = 60.0
"""How long past hivemind's own timeouts a call to the averager process is waited for before it counts as lost."""
_PIPE_TIMEOUT_S = 30.0
"""How long the trainer waits for the averager child to take a request (it answers in milliseconds)."""
_MEMBERS_MAX_AGE_S = 10.0
"""Read the run's records again at most this long after the last read (peers that left lose the door)..."""
_MEMBERS_MIN_AGE_S = 1.0
"""...and at least this long after it (an unknown caller may be a newcomer whose record just arrived)."""
_REFUSAL_MEMORY_S = 2 * _MEMBERS_MAX_AGE_S
"""A groupmate we refused this recently did not stall: hivemind counts it as a sender that never came."""


MAX_SERVING = 4
"""The most state downloads a donor serves at once (one per peer): each holds a copy of the state in the
averager process while it lasts, so a peer that opens many and reads none must not make it hold more."""
STALLED_DOWNLOAD_S = 60.0
"""How long a donor waits for a downloader to take the next piece of its state: a stream nobody reads
ends then, and frees its copy (a slow link only makes each piece slower, never this slow)."""
IDLE_DOWNLOAD_S = 10.0
"""With all :data:`MAX_SERVING` places taken, a download whose reader has left a piece waiting this long gives
its place to a new downloader..."""
MIN_SERVING_RATE = 32 * 1024
"""...as does one that has taken less than this many bytes a second (256 kbit/s) since its first piece, once
that is :data:`RATE_JUDGED_S` ago: a few identities that read a piece now and then would otherwise hold every
place of a donor, and newcomers could not load the swarm's state from it (:func:`to_preempt`). Low, because a
donor's own upload is shared by its downloads: four at once on a 1 Mbit/s uplink are each this slow, and one
ended is progress lost."""
RATE_JUDGED_S = 30.0
REASK_S = 5.0
"""A peer that asks for the state again this soon after its last download began is refused (each download
costs the donor a snapshot of its state); later, its earlier download ends and the new one takes its place."""
RENEWAL_S = 2 * RATE_JUDGED_S
"""A peer that asks for the state again this soon after a download of its own ended unfinished goes on with
that download's count: renewing a download every few seconds does not make a slow reader a new one."""


@dataclass
class _Serving:
    """A state download we serve (``ExactAverager.rpc_download_state``)."""

    task: asyncio.Task | None
    """Its handler's task (hivemind makes one per stream): cancelling it ends the download."""
    first_piece_at: float | None = None
    """When its first piece was ready (monotonic): what its rate counts from (making the state ready, which
    the donor does, is not the reader's time)."""
    sent: int = 0
    """Bytes its reader has taken."""
    waiting_since: float | None = None
    """Since when a piece has waited for the reader to take it (None: none waits: the donor is making the
    next)."""
    last_at: float = 0.0
    """When it last moved (began, or a piece was taken): a download that took nothing for twice
    :data:`STALLED_DOWNLOAD_S` has ended."""


def to_preempt(serving: Mapping[str, _Serving], now: float) -> str | None:
    """Which download ends to make place for a new one when every place is taken: the one whose reader has
    left a piece waiting longest, if for :data:`IDLE_DOWNLOAD_S`; else the slowest whose first piece is
    :data:`RATE_JUDGED_S` ago and that read under :data:`MIN_SERVING_RATE` since; else none (the newcomer
    asks another donor)."""
    waits = {p: now - s.waiting_since for p, s in serving.items() if s.waiting_since is not None}
    idle = max(waits, key=waits.__getitem__, default=None)
    if idle is not None and waits[idle] >= IDLE_DOWNLOAD_S:
        return idle
    rates = {
        p: s.sent / (now - s.first_piece_at)
        for p, s in serving.items()
        if s.first_piece_at is not None and now - s.first_piece_at >= RATE_JUDGED_S
    }
    slowest = min(rates, key=rates.__getitem__, default=None)
    return slowest if slowest is not None and rates[slowest] < MIN_SERVING_RATE else None


class _Stopped(Exception):
    pass


_NO_GROUP = b"p2ptrain:no-group:"
"""What a client that a leader accepted and then sent no group sends its round's members instead of a group
id (``ExactAverager._say_no_group``), followed by the round: no group's id begins so (those are hashes)."""


def no_group_notice(round: int) -> bytes:
    return _NO_GROUP + round.to_bytes(8, "big", signed=True)


def notice_round(group_id: bytes) -> int | None:
    """The round of a :func:`no_group_notice`, or None if ``group_id`` is not one."""
    if not group_id.startswith(_NO_GROUP) or len(group_id) != len(_NO_GROUP) + 8:
        return None
    return int.from_bytes(group_id[len(_NO_GROUP) :], "big", signed=True)


def round_group_bits(round: int) -> str:
    """Matchmaking group bits for a round: its binary digits (hivemind keys are prefix.0b<bits>)."""
    return format(round, "b")


class ExactAllReduceRunner(AllReduceRunner):
    """An AllReduceRunner whose reducers return the averaged part itself, identically to every member."""

    def __init__(
        self,
        *,
        tensors: Sequence[torch.Tensor],
        peer_fractions,
        max_weight: float = math.inf,
        weights: Mapping[str, float] | None = None,
        sealed: Mapping[str, Sealed] | None = None,
        aggregate: Aggregate = mean,
        on_fault: Callable[[PeerID, Fault, str], None] | None = None,
        on_part_served: Callable[[], None] | None = None,
        **kwargs,
    ):
        self._on_part_served = on_part_served
        self.max_weight = max_weight
        self.weights = weights or {}
        """A verifiable round's verdict: the weight each sender counts with, whatever it claims."""
        self.sealed = sealed
        """A verifiable round's seals: each sender's parts must be the ones it sealed and sketched."""
        self._on_fault = on_fault
        container_kwargs = {
            k: kwargs[k]
            for k in ("compression", "part_size_bytes", "tensor_infos", "prefetch")
            if k in kwargs
        }
        super().__init__(tensors=tensors, peer_fractions=peer_fractions, **kwargs)
        # Rebuild the container so that outputs are averages, not deltas (and a failed reducer's slice
        # would come back as our own values, which _run_allreduce_inplace_ refuses).
        self.tensor_part_container = TensorPartContainer(
            tensors, peer_fractions, return_deltas=False, **container_kwargs
        )
        my_index = self.ordered_peer_ids.index(self.peer_id)
        self._my_part_infos = [info for _, info in self.tensor_part_container._input_parts_by_peer[my_index]]
        # What each reducer must send back: parts of exactly these shapes (taken before sending consumes them).
        self._part_shapes_by_peer = [
            [part.shape for part, _ in parts] for parts in self.tensor_part_container._input_parts_by_peer
        ]
        by_peer = self.tensor_part_container._input_parts_by_peer
        # Parts are numbered in one order whoever reduces them: ours start after the earlier reducers'.
        self._first_part = sum(len(parts) for parts in by_peer[:my_index])
        self._layout = (
            sketch_layout([part.numel() for parts in by_peer for part, _ in parts]) if sealed else ()
        )
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(my_index)
        # hivemind's reducer, made by super().__init__ and never used: finished, or its finalize (when it is
        # collected, at once) warns "Reducer: received 0.0% of input tensors" in every peer's log every round.
        self.tensor_part_reducer.finished.set()  # type: ignore[has-type]  # hivemind's, untyped
        self.tensor_part_reducer = RobustPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging),
            len(self.sender_peer_ids),
            aggregate=aggregate,
        )
        self._serialized_averages: dict[int, asyncio.Future] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        self.misbehaved: set[PeerID] = set()
        self.absent: set[PeerID] = set()
        """Groupmates that said they hold no such group (``Fault.ABSENT``)."""
        self._complete_senders: set[PeerID] = set()
        """Senders all of whose parts went into our slice (and got our answers)."""

    async def _serialized_average(self, part_index: int, averaged_part: torch.Tensor):
        """Serialize our averaged part once; every groupmate (and we) get exactly these bytes."""
        future = self._serialized_averages.get(part_index)
        if future is None:
            future = self._serialized_averages[part_index] = asyncio.get_event_loop().run_in_executor(
                None,
                lambda: self.tensor_part_container.compression.compress(
                    averaged_part, self._my_part_infos[part_index], allow_inplace=False
                ),
            )
        return await future

    async def _communicate_with_peer(self, peer_id: PeerID):
        peer_index = self.ordered_peer_ids.index(peer_id)
        if peer_id == self.peer_id:
            sender_index = self.sender_peer_ids.index(peer_id)
            weight = self.weights.get(self.peer_id.to_base58(), self.weight)  # ours too: the verdict's
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged_part = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=weight
                )
                serialized = await self._serialized_average(part_index, averaged_part)
                self.tensor_part_container.register_processed_part(
                    peer_index, part_index, deserialize(serialized)
                )
            return
        try:
            done_sending = asyncio.Event()
            inputs_aiter = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            # Opening the stream has no timeout of its own in hivemind; a groupmate that died can hold it open.
            stream = await asyncio.wait_for(
                self._get_peer_stub(peer_id).rpc_aggregate_part(inputs_aiter), self.reducer_timeout
            )
            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            expected = self._part_shapes_by_peer[peer_index]

            def _deserialize(item):
                index, msg = item
                code = averaging_pb2.MessageCode.Name(msg.code)
                if msg.code in (averaging_pb2.BAD_GROUP_ID, averaging_pb2.CANCELLED):
                    raise NotInGroup(f"{peer_id} answered {code}")
                if msg.code != averaging_pb2.AVERAGED_PART:
                    # INTERNAL_ERROR is also what a reducer answers when we, the sender, were too slow.
                    raise AllreduceException(f"{peer_id} sent {code}")
                self.bytes_received += len(msg.tensor_part.buffer)
                return _decoded(msg.tensor_part, _nth(expected, index))

            part_index = 0
            # We close the stream once every answer is in, never the reducer (whose handler waits for that,
            # ``ExactAverager.rpc_aggregate_part``): p2pd resets a stream that its handler closes while the
            # caller still reads, and the answer in flight was lost ("a reducer left mid-way", part short).
            answers = amap_in_executor(
                _deserialize,
                _numbered(aiter_with_timeout(stream, self.reducer_timeout)),
                max_prefetch=self.tensor_part_container.prefetch,
            )
            async with contextlib.aclosing(answers):
                async for averaged in answers:
                    # A reducer's answer is checked like any input: it becomes our params.
                    problem = part_problem(averaged, _nth(expected, part_index))
                    if problem is not None:
                        self._fault(
                            peer_id, Fault.MISBEHAVED, f"as a reducer, its part {part_index}: {problem}"
                        )
                        raise AllreduceException(
                            f"{peer_id} sent a bad averaged part {part_index}: {problem}"
                        )
                    self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
                    part_index += 1
                    if part_index == len(expected):
                        break
            if part_index != self.tensor_part_container.num_parts_by_peer[peer_index]:
                raise AllreduceException(
                    f"peer {peer_id} sent {part_index} parts, expected "
                    f"{self.tensor_part_container.num_parts_by_peer[peer_index]}"
                )
        except asyncio.TimeoutError:
            self._fault(peer_id, Fault.STALLED, f"as a reducer, silent for {self.reducer_timeout:.0f}s")
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise
        except NotInGroup as e:
            # It will send us nothing either: stop waiting for its parts (it is no staller), void this attempt.
            await self.mark_absent(peer_id, str(e))
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise
        except BaseException as e:
            # hivemind logs what ends this task at debug only: say which reducer failed us, and how.
            log.warning(
                "a reducer's answer stopped",
                reducer=peer_id.to_base58(),
                parts=self.tensor_part_container._outputs_registered_by_peer[peer_index],
                of=self.tensor_part_container.num_parts_by_peer[peer_index],
                error=repr(e)[:300],
            )
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _ban_sender(self, peer_id: PeerID) -> None:
        """hivemind drops a sender whose stream ends in any way but its end-of-stream message; one whose every
        part is in has done its share: it closes the stream first now, once it has our last answer."""
        if peer_id in self._complete_senders:
            return
        await super()._ban_sender(peer_id)

    async def mark_absent(self, peer_id: PeerID, reason: str) -> None:
        """``peer_id`` is not averaging this group (``Fault.ABSENT``): we stop waiting for its parts."""
        if peer_id in self.absent:
            return
        self.absent.add(peer_id)
        self._fault(peer_id, Fault.ABSENT, reason)
        if peer_id in self.sender_peer_ids:
            await self._ban_sender(peer_id)

    def _fault(self, peer_id: PeerID, fault: Fault, reason: str) -> None:
        if fault == Fault.MISBEHAVED:
            self.misbehaved.add(peer_id)
        if self._on_fault is not None:
            self._on_fault(peer_id, fault, reason)

    async def _handle_missing_senders(self):
        """A groupmate that never starts sending within the timeout is left out of this all-reduce (by
        hivemind) and reported as stalled (here)."""
        await super()._handle_missing_senders()
        for peer_id in self.sender_peer_ids:
            if peer_id in self.absent:
                continue
            if peer_id not in self.active_senders and peer_id in self.banned_senders:
                self._fault(peer_id, Fault.STALLED, f"as a sender, silent for {self.sender_timeout:.0f}s")

    async def _generate_input_for_peer(self, peer_index: int):
        async for msg in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += len(msg.tensor_part.buffer)
            yield msg

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        part_index = 0
        sender = self.sender_peer_ids[sender_index]
        ended = "by the sender or a refusal"
        try:
            async for tensor_part, weight, problem in amap_in_executor(
                lambda item: self._receive(sender.to_base58(), *item),
                _numbered(stream),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                # What a groupmate sends is never trusted: a bad part leaves it out of this all-reduce (the
                # finally below bans it, and the reducer averages the others' parts without it).
                if problem is not None:
                    self._fault(sender, Fault.MISBEHAVED, f"as a sender, its part {part_index}: {problem}")
                    break
                weight = self.weights.get(sender.to_base58(), weight)
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                except Exception as e:  # BannedException: this sender was dropped, stop serving it
                    ended = f"dropped: {e!r}"
                    break
                serialized = await self._serialized_average(part_index, averaged_part)
                part_index += 1
                if part_index == self.tensor_part_reducer.num_parts:
                    self._complete_senders.add(sender)
                self.bytes_sent += len(serialized.buffer)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                if self._on_part_served is not None:
                    self._on_part_served()
        except asyncio.TimeoutError:
            self._fault(sender, Fault.STALLED, f"as a sender, silent for {self.sender_timeout:.0f}s")
            raise
        except asyncio.CancelledError:
            ended = "cancelled"  # hivemind's handler ends us when the sender's stream closes under it
            raise
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                # hivemind says nothing above debug here: a sender we refused, dropped, or whose stream closed
                # under us (it left, or reset) gets no more answers from us, and fails its all-reduce.
                log.warning(
                    "a sender's stream ended early",
                    sender=sender.to_base58(),
                    parts=part_index,
                    of=self.tensor_part_reducer.num_parts,
                    ended=ended,
                )
                await self._ban_sender(sender)

    def _receive(self, sender: str, index: int, msg) -> tuple[torch.Tensor | None, float, str | None]:
        """Decode and check one part a sender sent us (in a worker thread): the part, its weight, and what
        is wrong with it (None: nothing)."""
        self.bytes_received += len(msg.tensor_part.buffer)
        shape = _nth(self.tensor_part_reducer.part_shapes, index)
        part, weight = _decoded(msg.tensor_part, shape), msg.weight
        problem = part_problem(part, shape)
        if problem is None and not (math.isfinite(weight) and 0 < weight <= self.max_weight):
            problem = f"weight {weight!r} is not in (0, {self.max_weight:g}]"
        verdict_weight = self.weights.get(sender)
        if problem is None and verdict_weight is not None and not math.isclose(weight, verdict_weight):
            problem = f"it claims weight {weight:g} where the verdict gives it {verdict_weight:g}"
        if problem is None and self.sealed is not None:
            sealed = self.sealed.get(sender)
            if sealed is None:
                problem = "it sealed nothing in this round"
            else:
                assert part is not None  # part_problem found none: it decoded
                digest = part_digest(msg.tensor_part)
                problem = sent_problem(sealed, self._first_part + index, digest, part, self._layout)
        return part, weight, problem


class RobustPartReducer(TensorPartReducer):
    """hivemind's reducer with the combining step replaced, the senders' bookkeeping (who sent which part,
    who was dropped) unchanged.

    hivemind adds each sender's part into a running sum and divides by the total weight once every sender's
    part is in. This one collects the parts, in sender order (so that the result does not depend on the
    order they arrived in), and ``aggregate``s them (``aggregation.py``) in a worker thread: a robust
    aggregate takes long enough (4 ms for a part of 128 Ki values from 3 senders on this machine, more when
    someone is clipped and in large groups) that in the event loop it would hold up every other stream of the
    averager.
    """

    def __init__(self, part_shapes: Sequence[torch.Size], num_senders: int, *, aggregate: Aggregate):
        self._aggregate = aggregate
        self.parts_left_out: dict[int, int] = {}
        """How many of each sender's parts the aggregate left out, by sender index."""
        super().__init__(part_shapes, num_senders)

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        # hivemind hands the part to the accumulator's add_ and nothing else: ours gets the sender with it.
        sent = typing.cast(torch.Tensor, _Sent(sender_index, tensor_part))
        return await super().accumulate_part(sender_index, part_index, sent, weight=weight)

    def reset_accumulators(self) -> None:
        super().reset_accumulators()
        if not self.finished.is_set():
            self.accumulator = _Collected()

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from < self.num_current_senders:
            return
        collected: _Collected = self.accumulator
        result: asyncio.Future = self.current_part_future  # type: ignore[has-type]
        # The next part starts at once. After the last part hivemind's finalize cancels the current future:
        # it gets a stand-in, not the one this part's senders are waiting on.
        self.current_part_future: asyncio.Future = asyncio.Future()
        self.reset_accumulators()
        work = asyncio.get_event_loop().run_in_executor(None, collected.aggregate, self._aggregate)
        work.add_done_callback(lambda done: self._settle(result, done))

    def _settle(self, future: asyncio.Future, done: asyncio.Future) -> None:
        """Pass a finished aggregate (or its error, so that nobody waits for it forever) to the part's
        senders, and count the senders whose part it left out."""
        if future.done():  # the all-reduce was cancelled meanwhile
            return
        if done.cancelled():
            future.cancel()
        elif done.exception() is not None:
            future.set_exception(typing.cast(BaseException, done.exception()))
        else:
            tensor, left_out = done.result()
            for sender in left_out:
                self.parts_left_out[sender] = self.parts_left_out.get(sender, 0) + 1
            future.set_result(tensor)


class _Sent(typing.NamedTuple):
    sender: int
    part: torch.Tensor


class _Collected:
    """Stands in for hivemind's accumulator tensor: ``add_`` keeps each sender's part and weight."""

    def __init__(self) -> None:
        self._sent: list[tuple[int, torch.Tensor, float]] = []

    def add_(self, sent: _Sent, *, alpha: float) -> None:
        self._sent.append((sent.sender, sent.part, alpha))

    def aggregate(self, aggregate: Aggregate) -> tuple[torch.Tensor, list[int]]:
        """The aggregate, and the senders whose part it left out."""
        # Our own part always reaches our own reducer (we are never dropped by ourselves): there is one at least.
        ordered = sorted(self._sent, key=lambda item: item[0])
        out = aggregate([part for _, part, _ in ordered], [weight for _, _, weight in ordered])
        return out.tensor, [ordered[i][0] for i in out.left_out]


@dataclass
class _Outcome:
    """What the averager child tells the trainer about its last all-reduce, besides the average."""

    bytes_sent: int = 0
    bytes_received: int = 0
    dropped: list[str] = field(default_factory=list)
    """Senders our reducer dropped (they stalled, or sent nothing we could use): not in this average."""
    outliers: dict[str, int] = field(default_factory=dict)
    """Groupmates whose parts our reducer's aggregate left out, and how many parts."""
    refused: list[str] = field(default_factory=list)
    """Every peer left out for good so far for what this averager saw it do (``LeftOut.for_good``; bans,
    which the trainer knows, not included), as of this all-reduce."""
    stalled: list[str] = field(default_factory=list)
    """Peers left out of the next rounds for stalling (LeftOut), as of this all-reduce."""
    allreduce_s: float = 0.0
    """From the moment the group was formed to the end of the all-reduce (the step's rest is matchmaking)."""


class Fault(str, Enum):
    """What a groupmate did wrong in an all-reduce."""

    MISBEHAVED = "misbehaved"
    """Sent something no honest peer sends: a part that does not decode, of the wrong shape, not finite, or
    a weight out of bounds. Left out for the rest of the run."""
    STALLED = "stalled"
    """Sent nothing for a whole timeout, while connected. Left out for 16 rounds, doubling with each stall
    (an honest peer stalls rarely; one that stalls on purpose soon costs nothing)."""
    ABSENT = "absent"
    """Is not averaging our group: it said it holds no such group (it never got the group from the leader,
    whose answer came after its matchmaking gave up or never came, or the leader told it another group than
    ours) or that it gave the group up, or it sent its parts under another group's id (or we answered its
    parts that we hold no such group, and came to hold it a moment later). Left out of the
    round's retry, not longer: nothing it did is known to be wrong, and the leader may be the one at fault.
    Not even that in a round where a groupmate misbehaved: an honest peer that had already left that one out
    declines any group that holds it, which explains its absence (the retry then meets it without the
    misbehaving one; before 2026-12-06 the two honest peers of the attack benchmark lost the round so)."""
    MALFORMED_JOIN = "malformed_join"
    """Its join data, as the leader relayed it, is malformed: the attempt is void. Left out of the round's
    retry (or it would void that too), not longer: the leader may have made it."""

    @property
    def one_round(self) -> bool:
        """Whether the peer is left out of the round it did this in only."""
        return self in (Fault.ABSENT, Fault.MALFORMED_JOIN)


def _decoded(part, shape: torch.Size | None) -> torch.Tensor | None:
    """A serialized tensor part that should have ``shape``, or None if it claims another shape (checked before
    decoding, so that a claimed size cannot make us allocate) or does not decode (garbage from a groupmate)."""
    if shape is None or tuple(part.size) != tuple(shape):
        return None
    try:
        return deserialize(part)
    except Exception:  # any malformed buffer or dtype: the caller reports it as misbehaviour
        return None


def _nth(shapes: Sequence[torch.Size], index: int) -> torch.Size | None:
    """The expected shape of part ``index``, or None past the last part."""
    return shapes[index] if index < len(shapes) else None


async def _numbered(stream):
    """(index, message) for each message of a stream, counted in the event loop (decoding runs in threads)."""
    index = 0
    async for message in stream:
        yield index, message
        index += 1


def part_problem(part: torch.Tensor | None, shape: torch.Size | None) -> str | None:
    """What is wrong with a received tensor part that should have ``shape``, or None if nothing is."""
    if shape is None:
        return "one part too many"
    if part is None:
        return f"it does not decode to a tensor of shape {tuple(shape)}"
    if part.shape != shape:  # never broadcast: exact shape
        return f"shape {tuple(part.shape)}, expected {tuple(shape)}"
    if part.dtype != torch.float32:
        return f"dtype {part.dtype}, expected float32"
    if not bool(torch.isfinite(part).all()):
        return "non-finite values"
    return None


_FIRST_ASK_AGAIN_S = 0.05
"""How soon a follower asks its named leader again after a refusal (then twice as late each time)."""


def barrier_leader(peers: Sequence[str], round: int, *, rotating: bool = True) -> str:
    """Who leads the group the barrier named for ``round``: the peer whose id hashes lowest with the round
    (``rotating``, with ``averaging.agreed_groups``), else the lowest id (releases before 2026-12-06).

    A leader can void the attempts it leads (withhold the group from a member, relay a malformed join), and a
    key holder can make as many identities as it likes: under the lowest id, one ground to sort first would
    lead every group of the run. Under the hash, a peer leads about one round in N, whichever ids it makes.
    """
    if not rotating:
        return min(peers)
    return min(peers, key=lambda peer: hashlib.sha256(f"{round}:{peer}".encode()).digest())


class BarrierLeaders(PotentialLeaders):
    """hivemind's leader search, unless the trainer named the group (:meth:`name`): then no DHT at all.

    Every member of a named group asks the same leader, :func:`barrier_leader` (asking again, a little
    later each time, while it is not looking for a group yet); the leader asks nobody and takes join requests
    until the group is full (``target_group_size`` is its size) or, past ``min_matchmaking_time``, assembles
    what came. Its expiration is earlier than its followers', as hivemind's leaders' are (it refuses a
    follower that would expire before it). A named group is for one search, the round's first attempt.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.named: PeerID | None = None
        """The leader of the next search's group (None: search the DHT as hivemind does)."""
        self._leader: PeerID | None = None  # of the search under way
        self._asked = 0
        self._refused: str | None = None  # why the named leader will not seat us in this search

    def name(self, leader: PeerID) -> None:
        self.named = leader

    @contextlib.asynccontextmanager
    async def begin_search(self, step, key_manager, declare: bool = True):
        leader, self.named = self.named, None
        if leader is None:
            async with super().begin_search(step, key_manager, declare=declare):
                yield self
            return
        async with self.lock_search:
            self._leader, self._asked, self._refused = leader, 0, None
            self.running.set()
            self.search_end_time = step.deadline if step.deadline is not None else float("inf")
            # The leader expires first: its followers' requests must not expire before it (hivemind's rule).
            lead = leader == self.peer_id
            self.declared_group_key = key_manager.current_key
            self.declared_expiration_time = get_dht_time() + self.min_matchmaking_time * (1 if lead else 2)
            try:
                yield self
            finally:
                self._leader = None
                self.running.clear()
                self.declared_group_key, self.declared_expiration_time = None, float("inf")
                self.search_end_time = float("inf")

    def refused(self, leader: PeerID, why: str) -> None:
        """The named leader of the search under way will not seat us: end the search (the attempt fails)."""
        if leader == self._leader:
            self._refused = why

    async def pop_next_leader(self) -> PeerID:
        if self._leader is None:
            return await super().pop_next_leader()
        if self._refused is not None:
            raise NamedLeaderRefused(f"the named leader {self._leader} {self._refused}")
        if self._leader != self.peer_id:
            # _request_join_potential_leaders asks it; a refusal (it is not looking for a group yet, say) brings
            # it back here: ask again, a little later each time, until the step's deadline ends the search.
            if self._asked:
                await asyncio.sleep(
                    min(_FIRST_ASK_AGAIN_S * 2 ** (self._asked - 1), self.min_matchmaking_time / 2)
                )
            self._asked += 1
            return self._leader
        # The leader waits for its followers (they call rpc_join_group); at its expiration, hivemind assembles
        # what came (or disbands it and asks again: a new expiration).
        await asyncio.sleep(max(0.0, self.declared_expiration_time - get_dht_time()))
        self.declared_expiration_time = get_dht_time() + self.min_matchmaking_time
        raise asyncio.TimeoutError("the named group did not fill up in time")


class NamedLeaderRefused(MatchmakingException):
    """The leader the barrier named refused us for good: the first attempt is over (a retry searches the DHT)."""


_REFUSED_FOR_GOOD = {
    averaging_pb2.GROUP_IS_FULL: (
        "its group is full without us (we are not on its roster, or came after it formed the group)"
    ),
    averaging_pb2.NOT_A_LEADER: "it follows another leader (its group is not ours)",
}
"""A named leader's answers that no later ask changes in this attempt. It answers NOT_LOOKING_FOR_GROUP while it
is not looking for a group yet: asked again."""


class _AnswersNoted:
    """Matchmaking's stubs for join requests, noting the code of each leader's first answer, and the last
    answer of the last leader asked (hivemind keeps them to itself: it logs them at debug level and returns
    None)."""

    def __init__(self, servicer_type):
        self._servicer_type = servicer_type
        self.forget()

    def forget(self) -> None:
        self.code: int | None = None
        self.last: int | None = None
        self.last_from: PeerID | None = None
        self.accepted_at: float | None = None  # time.monotonic() of the last ACCEPTED

    def get_stub(self, p2p, peer, *, namespace=None) -> _NotingStub:
        return _NotingStub(self._servicer_type.get_stub(p2p, peer, namespace=namespace), self, peer)

    @property
    def accepted(self) -> bool:
        """Whether a leader accepted us since :meth:`forget` (hivemind's ``was_accepted_to_group`` is cleared
        as that leader's stream ends)."""
        return self.accepted_at is not None

    def held_us(self, *, cancelled: bool, honest_wait_s: float) -> PeerID | None:
        """The leader that accepted us and then sent no group, if one did: it held the stream open, or ended it
        without a word. hivemind's leader sends the group or disbands it by its expiration, which comes at
        most ``honest_wait_s`` after it accepted us; ``cancelled``: our own search ended first (it held us
        only if that was later than that)."""
        if self.last != averaging_pb2.ACCEPTED:
            return None
        if cancelled and time.monotonic() - (self.accepted_at or 0.0) <= honest_wait_s:
            return None
        return self.last_from


class _NotingStub:
    def __init__(self, stub, noted: _AnswersNoted, peer: PeerID):
        self._stub, self._noted, self._peer = stub, noted, peer

    async def rpc_join_group(self, request):
        stream = await self._stub.rpc_join_group(request)
        return self._answers(stream)

    async def _answers(self, stream):
        noted = self._noted
        noted.last, noted.last_from = None, self._peer
        try:
            async for message in stream:
                if noted.code is None:
                    noted.code = message.code
                noted.last = message.code
                if message.code == averaging_pb2.ACCEPTED:
                    noted.accepted_at = time.monotonic()
                yield message
        finally:  # hivemind closes what it got: close the stream under it
            with contextlib.suppress(RuntimeError):
                await stream.aclose()


class LeftOut:
    """The groupmates this peer does not average with, and until which round: a pure record of faults, and
    of the bans the swarm's reputation holds (kept apart: a ban can be lifted, a fault seen stands).

    A peer that misbehaved is left out for the rest of the run. One that stalled (sent nothing for a whole
    timeout while connected) is left out of the round it stalled in, so that the retry of that round goes
    without it, and of the next ``STALL_ROUNDS - 1`` rounds, twice as many at each further stall: a peer
    that stalls on purpose costs us one timeout per 16 rounds at most, then fewer; an honest peer whose
    machine hung once trains on (rebasing onto the swarm's params) and averages with us again 16 rounds later.
    One that voided an attempt without being known to be at fault (``Fault.one_round``) is left out of that
    round's retry only, and one that was absent not at all in a round in which another misbehaved
    (``Fault.ABSENT``).
    """

    STALL_ROUNDS = 16
    MAX_STALL_ROUNDS = 1024

    def __init__(self) -> None:
        self._until: dict[str, float] = {}
        self._banned: set[str] = set()  # by the swarm's reputation (a ban can be lifted; a fault seen stands)
        self._stalls: dict[str, int] = {}
        self._last_stall: dict[str, int] = {}
        self._absent: dict[str, int] = {}  # the round each peer was last absent in (Fault.ABSENT)
        # The last round a groupmate misbehaved in: it explains that round's absences.
        self._misbehaved_in = -1

    def fault(self, peer: str, fault: Fault, round: int) -> float:
        """Record a fault of ``peer`` in ``round``; returns the last round it is left out of (inf: all)."""
        if fault == Fault.ABSENT:
            self._absent[peer] = round
            return max(self._until.get(peer, -1), -1 if self._explains(round) else round)
        if fault == Fault.MISBEHAVED:
            until = math.inf
            self._misbehaved_in = round
        elif fault.one_round:
            until = round
        elif self._last_stall.get(peer) == round:  # one stall per round, however many parts it held up
            until = self._until[peer]
        else:
            self._last_stall[peer] = round
            self._stalls[peer] = stalls = self._stalls.get(peer, 0) + 1
            until = round + min(self.STALL_ROUNDS * 2 ** (stalls - 1), self.MAX_STALL_ROUNDS) - 1
        self._until[peer] = max(self._until.get(peer, -1), until)
        return self._until[peer]

    def for_round(self, peer: str, round: int) -> None:
        """Leave ``peer`` out of ``round`` only (a verifiable round's verdict: its work was not verified; a
        leader that accepted us and sent no group)."""
        self._until[peer] = max(self._until.get(peer, -1), round)

    def ban(self, peer: str) -> None:
        """Leave ``peer`` out for good: the swarm's reputation bans it."""
        self._banned.add(peer)

    def unban(self, peer: str) -> None:
        """Lift :meth:`ban` (faults we saw ourselves stand)."""
        self._banned.discard(peer)

    def excludes(self, peer: str, round: float) -> bool:
        absent = self._absent.get(peer) == round and not self._explains(round)
        return peer in self._banned or absent or round <= self._until.get(peer, -1)

    def _explains(self, round: float) -> bool:
        """Whether a groupmate misbehaved in ``round``, which explains an absence in it (``Fault.ABSENT``)."""
        return self._misbehaved_in == round

    def for_good(self) -> list[str]:
        """The peers left out for the rest of the run for what we saw them do (bans not included)."""
        return sorted(p for p, until in self._until.items() if until == math.inf)

    def for_a_while(self, round: int) -> list[str]:
        """The peers left out of rounds after ``round``, not for good (they stalled)."""
        return sorted(p for p, until in self._until.items() if round < until < math.inf)


class NotInGroup(AllreduceException):
    """A groupmate answered BAD_GROUP_ID (it holds no group of this id) or CANCELLED (it gave the group up),
    not an averaged part: ``Fault.ABSENT``."""


class MalformedJoin(AllreduceException):
    """A member's join data, as the leader relayed it, is malformed (``Fault.MALFORMED_JOIN``)."""

    def __init__(self, peer: PeerID, message: str):
        super().__init__(message)
        self.peer = peer


def agreed_group(group: GroupInfo) -> GroupInfo:
    """``group`` under an id that commits to all of it: the leader's id, the members in order and what each
    of them joined with, as the leader relayed them to us.

    The leader sends each member the group on a stream of its own, so a hostile one can tell members
    different groups: another order, another member's mode, a member left out. Members who average by the
    leader's id alone would then cut the vector differently and take each other's parts for other slices:
    an average silently mixed from the wrong values, or a groupmate's honest part judged malformed and the
    groupmate left out for good. Under this id, members who hold different groups hold different ids: each
    answers the other that it holds no such group (hivemind's BAD_GROUP_ID) before any part is judged.
    """
    # Every field length-prefixed, and the count first: no two groups give the same bytes to hash (a review
    # found a longer leader's id that swallowed the first member's entry, for one member fewer).
    fields = [len(group.peer_ids).to_bytes(8, "big"), group.group_id]
    for peer, entry in zip(group.peer_ids, group.gathered, strict=True):
        fields += [peer.to_bytes(), entry]
    digest = hashlib.sha256()
    for field_ in fields:
        digest.update(len(field_).to_bytes(8, "big"))
        digest.update(field_)
    return GroupInfo(digest.digest(), tuple(group.peer_ids), tuple(group.gathered))


def checked_group(group: GroupInfo, me: PeerID, my_mode: AveragingMode, serializer: Any) -> GroupInfo:
    """``group`` as we average with it: every member's join data well formed, ours as we sent it, claimed
    bandwidths dropped and each member's own data cut down to its round.

    The group comes from its leader, a groupmate like any other. Whatever it relays decides how the vector
    is cut among reducers (hivemind gives a peer that claims more bandwidth a larger share, and none to one
    in client mode), and reaches the trainer through a pipe. So every member reduces an equal share unless it
    says it is a client, a leader that misreports our own mode is refused (a leader that demotes every
    honest member would reduce the whole vector alone: each of them refuses), and what reaches the trainer
    is flat (deep nesting would fail to cross the pipe and leave the trainer waiting).

    Raises:
        MalformedJoin: a member's data is malformed.
        AllreduceException: ours is not what we sent, or nobody in the group reduces.
    """
    entries, modes = [], []
    for peer, raw in zip(group.peer_ids, group.gathered, strict=True):
        try:
            bandwidth, mode_id, user_bytes = serializer.loads(raw)
            mode = AveragingMode(mode_id)
            if not isinstance(user_bytes, bytes) or (
                bandwidth is not None and not isinstance(bandwidth, int | float)
            ):
                raise TypeError("not (bandwidth, mode, bytes)")
        except Exception as e:  # msgpack's and the unpacking's zoo: any of them means a malformed join
            raise MalformedJoin(
                peer, f"{peer} joined the group with malformed data ({type(e).__name__})"
            ) from None
        if peer == me and mode != my_mode:
            raise AllreduceException(f"the group's leader reports us in mode {mode.name}, not {my_mode.name}")
        try:
            user = serializer.loads(user_bytes)
        except Exception:
            user = None
        flat = {"round": user["round"]} if isinstance(user, dict) and type(user.get("round")) is int else {}
        entries.append(serializer.dumps([None, mode.value, serializer.dumps(flat)]))
        modes.append(mode)
    if all(mode == AveragingMode.CLIENT for mode in modes):
        raise AllreduceException("every member of the group is a client: nobody reduces")
    return GroupInfo(group.group_id, tuple(group.peer_ids), tuple(entries))


class ExactAverager(ParentWatchdog, DecentralizedAverager):
    """hivemind's DecentralizedAverager with exact all-reduce, byte counts, chosen donors, a watchdog, and
    a door: only members of the run may call it.

    hivemind authorizes no averaging RPC. Here joining a group, sending a part and downloading the state
    are refused to a caller (its libp2p id, which the transport authenticates) that has no live progress
    record of the run: with a swarm key only key holders can write one (``membership.py``).
    """

    def __init__(
        self,
        *args,
        run_id: str,
        state_provider: Callable[[], tuple[dict, list[torch.Tensor]]],
        max_weight: float = math.inf,
        max_state_bytes: float = math.inf,
        aggregate: Aggregate = mean,
        agreed_groups: bool = True,
        **kwargs,
    ):
        self._watched_parent_pid = os.getpid()
        self._aggregate = aggregate
        self._agreed_groups = agreed_groups
        self._state_provider = state_provider
        self._run_id = run_id
        self._max_weight = max_weight
        self._max_state_bytes = max_state_bytes
        self._left_out = LeftOut()
        self._weights: dict[int, dict[str, float]] = {}
        self._sealed: dict[int, dict[str, Sealed]] = {}
        self._round = -1
        self._members: set[str] = set()
        self._members_read_at = -math.inf
        self._members_lock: asyncio.Lock | None = None
        self._reading_members = False
        self._refused_at: dict[str, float] = {}
        self._serving: dict[str, _Serving] = {}
        """The peers we are sending our state to (``rpc_download_state``)."""
        self._asked: dict[str, float] = {}
        """When each peer last began a download of our state (within :data:`REASK_S`)."""
        self._unfinished: dict[str, tuple[float, float, int]] = {}
        """Downloads that ended unfinished lately, by peer: when, their first piece's time and their bytes."""
        self._groupmates: dict[bytes, set[PeerID]] = {}
        self._held_ids: collections.deque[bytes] = collections.deque(maxlen=64)
        """The ids of the groups we held last (a part sent under one of them is a late one)."""
        self._absent_early: dict[bytes, set[PeerID]] = {}
        """Groupmates found to hold another group before our runner was made (``_sent_under_another_id``)."""
        self._refused = Throttle()
        self._roster: tuple[int, frozenset[str]] | None = None
        """The round ``expect_group`` named last, and its group: whom we seat in a group we lead then."""
        self._grouped_round: int | None = None
        """The round of the last group we formed or joined (``_register_allreduce_group``)."""
        super().__init__(*args, **kwargs)

    async def _admit(self, remote: PeerID, rpc: str) -> None:
        """Raise PermissionError (which hivemind sends back to the caller) unless ``remote`` is a member.

        A groupmate of a running all-reduce is in (matchmaking admitted it). A known member is answered from
        what we read last (and the records are read again in the background when that is old): a join
        request must be answered within ``averaging.request_timeout_s``. Only an unknown caller waits for a
        read, at most one per ``_MEMBERS_MIN_AGE_S``.
        """
        if any(remote in mates for mates in self._groupmates.values()):
            return
        peer = remote.to_base58()
        if peer in self._members:
            if time.monotonic() - self._members_read_at > _MEMBERS_MAX_AGE_S and not self._reading_members:
                asyncio.create_task(self._read_members())
            return
        if time.monotonic() - self._members_read_at > _MEMBERS_MIN_AGE_S:
            await self._read_members(unknown=peer)
        if peer in self._members:
            return
        now = time.monotonic()
        self._refused_at = {p: t for p, t in self._refused_at.items() if now - t < _REFUSAL_MEMORY_S}
        self._refused_at[peer] = now
        if count := self._refused.due():
            log.warning(
                "refused an averaging request from a peer that is not in this run",
                peer=peer,
                rpc=rpc,
                count=count,
                hint="it has no progress record of the run: without the swarm key it cannot have one",
            )
        raise PermissionError(
            f"{self.peer_id} refuses {rpc}: {peer} has no progress record in run {self._run_id!r} "
            "(does it hold the swarm's key, swarm.key_file, and the same run.run_id?)"
        )

    async def _read_members(self, unknown: str | None = None) -> None:
        """Read who has a live record of the run, from the table the DHT child keeps (``board.py``), which reads
        the DHT first if an ``unknown`` caller is not in it. A failed or empty read keeps what we knew."""
        if self._members_lock is None:  # made in this (the averager's) process and event loop
            self._members_lock = asyncio.Lock()
        async with self._members_lock:  # a caller that comes during a read waits for its result
            if time.monotonic() - self._members_read_at <= _MEMBERS_MIN_AGE_S:
                return  # someone read them while we waited
            self._reading_members = True
            try:
                members = await self.dht.board("live_members", peer=unknown, return_future=True)
            except Exception as e:  # the DHT child is busy or restarting: keep what we knew
                log.debug("could not read the run's records", error=repr(e))
                members = set()
            finally:
                self._reading_members = False
            if members:
                self._members = members
            self._members_read_at = time.monotonic()

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:  # hivemind reads these: typing's, not abc's
        await self._admit(context.remote_id, "to let it join a group")
        if self._left_out_now(context.remote_id):
            # It asks again and again until its matchmaking gives up (a named leader is asked with backoff):
            # a refusal, not an error, which hivemind would log with its traceback at every ask.
            log.debug("no seat for a peer we left out of this round", peer=str(context.remote_id))
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.NOT_LOOKING_FOR_GROUP)
            return
        # The checks of the round's roster are for requests of our round: one for the next round, come before
        # we began it (our all-reduce of this one just ended), is hivemind's to answer, "not looking yet". The
        # round is read from the request's key, not compared with our current key: hivemind shifts our group
        # bits once a group is assembled.
        ours = f"{self._matchmaking.group_key_manager.prefix}.0b{round_group_bits(self._round)}"
        roster = self._roster if request.group_key == ours else None
        if roster is not None and roster[0] == self._round and context.remote_id.to_base58() not in roster[1]:
            # The group is as large as the roster (target_group_size): a member of the run that is not on it
            # (a peer the barrier went without, or one after a seat) would take a rostered peer's seat.
            # Answered as a full group is (an error would log a traceback here at every ask).
            log.debug("no seat for a peer off the round's roster", peer=str(context.remote_id))
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_IS_FULL)
            return
        searching = self._matchmaking.is_looking_for_group  # a retry of the round, say
        if roster is not None and roster[0] == self._round == self._grouped_round and not searching:
            # A member of the roster that asks once the round's group was formed without it (it came after the
            # leader's matchmaking_time_s): hivemind answers that we are not looking for a group, which the
            # follower of a named group takes for "not yet", asking again until its matchmaking gives up (10
            # to 15 s), long after the others' retries. Full, it gives the named search up at once.
            log.debug("no seat left in the round's group", peer=str(context.remote_id))
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.GROUP_IS_FULL)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        remote = context.remote_id
        loop = asyncio.get_running_loop()
        # How long a groupmate's part may wait for our group (hivemind waits as long as our matchmaking goes
        # on, and then some: the groupmate would take us for a staller and leave us out for 16 rounds).
        deadline = loop.time() + self._group_wait_s()
        if not any(remote in mates for mates in self._groupmates.values()):
            # A groupmate may begin sending before our own matchmaking has handed us the group (the leader's
            # answer reached it first): wait for it before asking the records, which may not show a peer that
            # joined a moment ago.
            with contextlib.suppress(asyncio.TimeoutError):
                wait = max(0.0, min(self.request_timeout, deadline - loop.time()))
                await asyncio.wait_for(self._pending_groups_registered.wait(), wait)
        await self._admit(remote, "to average its part")
        try:  # a caller that opens the stream and sends nothing must not hold this handler for good (hivemind
            # gives a sender its whole sender_timeout to begin: twice the group's wait)
            request = await asyncio.wait_for(
                anext(stream), max(0.0, deadline + self._group_wait_s() - loop.time())
            )
        except (asyncio.TimeoutError, StopAsyncIteration):
            return
        declined = False
        if await self._holds_group(request.group_id, deadline):
            try:
                async for message in super().rpc_aggregate_part(achain(as_aiter(request), stream), context):
                    yield message
            except NotInGroup:  # we gave the group up before our all-reduce began (_register_allreduce_group)
                declined = True
        else:
            declined = True
            said = notice_round(request.group_id)  # a notice of another round is a late one: nothing now
            if said is None or said == self._round:
                reason = "it sent its parts under another group's id"
                if said is not None:
                    reason = "it says the leader accepted it and sent it no group"
                await self._sent_under_another_id(remote, request.group_id, reason)
        if declined:
            # Should we come to hold this very group after all (our matchmaking ends after the wait), its
            # runner starts without the caller, which took our answer and sends us nothing more.
            self._absent_early.setdefault(request.group_id, set()).add(remote)
            while len(self._absent_early) > 64:  # those of groups we never come to hold
                self._absent_early.pop(next(iter(self._absent_early)))
            yield averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)  # the caller's Fault.ABSENT
        # Our last answer may still be on its way: were we to end now, p2pd would reset the stream under it.
        # The caller closes the stream once it has every answer, which ends this handler (cancelled); a caller
        # of a release before 2026-12-04 waits for us to close instead, so we do after a while.
        await asyncio.sleep(self.request_timeout)

    def _group_wait_s(self) -> float:
        """Half a sender's timeout: a part that waits for our group gets its answer (BAD_GROUP_ID) well before
        its sender, whose timeouts are the swarm's defaults unless it changed them, takes us for a staller."""
        return (self.allreduce_kwargs.get("sender_timeout") or 2 * self.request_timeout) / 2

    async def _holds_group(self, group_id: bytes, deadline: float) -> bool:
        """Whether we hold (or, by ``deadline``, come to hold) the group ``group_id``: a group the leader
        answered us last arrives a moment after a groupmate's first part."""
        loop = asyncio.get_running_loop()
        while group_id not in self._running_groups:
            left = deadline - loop.time()
            if left <= 0 or self._pending_groups_registered.is_set():
                return False  # out of time, or no group of ours is on its way
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._pending_groups_registered.wait(), left)
        return True

    async def _sent_under_another_id(self, remote: PeerID, group_id: bytes, reason: str) -> None:
        """A member of a group we hold sent us its parts under an id we never held: it holds another group
        (the leader told us different groups), or none (:func:`no_group_notice`), so it will send us nothing
        under ours. Our runner stops waiting for it (``Fault.ABSENT``), as a caller does when we answer
        BAD_GROUP_ID: a groupmate that never calls us (a client, or a node with nothing to reduce) is found
        out this way only. A part of a group we held before is a late one, from an attempt that is over:
        nothing about this one."""
        if group_id in self._held_ids:
            return
        for held, mates in list(self._groupmates.items()):
            if remote not in mates:
                continue
            future = self._running_groups.get(held)
            if future is not None and future.done() and not future.cancelled() and not future.exception():
                await future.result().mark_absent(remote, reason)
            else:  # our runner is not made yet: it starts without it (_run_allreduce_inplace_)
                self._absent_early.setdefault(held, set()).add(remote)

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        await self._admit(context.remote_id, "to send it the state")
        peer = context.remote_id.to_base58()
        if self._left_out.excludes(peer, math.inf):
            raise PermissionError(f"{self.peer_id} serves no state to {context.remote_id}: it is banned")
        now = time.monotonic()
        # A download that took no piece for twice the stall limit has ended, or ends now.
        for gone in [p for p, s in self._serving.items() if now - s.last_at >= 2 * STALLED_DOWNLOAD_S]:
            self._end_download(gone, now, reason="stalled")
        self._unfinished = {p: u for p, u in self._unfinished.items() if now - u[0] < RENEWAL_S}
        self._asked = {p: t for p, t in self._asked.items() if now - t < REASK_S}
        if peer in self._asked:
            raise PermissionError(
                f"{self.peer_id} began sending its state to {peer} under {REASK_S:.0f} s ago"
            )
        if peer in self._serving:  # it asks again (its last stream broke, or it opens more): that one ends
            self._end_download(peer, now, reason="the peer asked again")
        elif len(self._serving) >= MAX_SERVING and (victim := to_preempt(self._serving, now)) is not None:
            self._end_download(victim, now, reason=f"to serve {peer[-8:]}")
        if len(self._serving) >= MAX_SERVING:
            # The downloader asks its next donor (hivemind sends the error back to it).
            raise PermissionError(
                f"{self.peer_id} is sending its state to {len(self._serving)} peers: ask another donor"
            )
        # A stream whose reader stalls blocks hivemind's handler in a write that nothing else ends: cancel it
        # when one piece has waited too long (the handler's task is ours alone: hivemind makes one per stream).
        # Not the whole download: a large state over a slow link takes as long as it takes.
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        # Ours alone: a finished download of this peer's, closed late, must not free a newer one.
        serving = self._serving[peer] = _Serving(task, last_at=now)
        self._asked[peer] = now
        if peer in self._unfinished:  # a renewal: its rate goes on from the last download's
            _, serving.first_piece_at, serving.sent = self._unfinished.pop(peer)
        stalled = None
        finished = False
        try:
            async for message in super().rpc_download_state(request, context):
                stalled = loop.call_later(STALLED_DOWNLOAD_S, task.cancel) if task else None
                serving.waiting_since = time.monotonic()
                if serving.first_piece_at is None:
                    serving.first_piece_at = serving.waiting_since
                yield message  # hivemind writes it to the stream before it asks for the next
                if stalled is not None:
                    stalled.cancel()
                serving.waiting_since, serving.last_at = None, time.monotonic()
                serving.sent += len(message.metadata) + len(message.tensor_part.buffer)
            finished = True
        finally:
            if stalled is not None:
                stalled.cancel()
            if self._serving.get(peer) is serving:  # not ended by _end_download, which did this itself
                del self._serving[peer]
                if not finished and serving.first_piece_at is not None:
                    self._unfinished[peer] = (time.monotonic(), serving.first_piece_at, serving.sent)

    def _end_download(self, peer: str, now: float, *, reason: str) -> None:
        """End the state download we serve ``peer`` (its handler's task is cancelled) and free its place."""
        ended = self._serving.pop(peer)
        if ended.task is not None:
            ended.task.cancel()
        if ended.first_piece_at is not None:  # its count goes on if it asks again (RENEWAL_S)
            self._unfinished[peer] = (now, ended.first_piece_at, ended.sent)
        log.info(
            "ended a state download",
            peer=peer[-8:],
            why=reason,
            waiting_s=None if ended.waiting_since is None else round(now - ended.waiting_since, 1),
            bytes_sent=ended.sent,
        )

    def run(self) -> None:
        self._start_parent_watchdog(lambda: self._outer_pipe.send(("_shutdown", [self.shutdown_timeout], {})))
        # If the parent created torch's thread pool before forking us (torch.set_num_threads does), the first
        # use in this child replaces the inherited pool, and two threads doing that at once race: one sees
        # no pool and fails with "Invalid thread pool!", silently stalling that all-reduce until groupmates
        # time us out. Replace it here, once, before any worker thread exists.
        torch.set_num_threads(torch.get_num_threads())
        unbind("round")  # inherited at fork time; this process does not follow the trainer's rounds
        # Forked before the trainer bound it: say whose lines these are.
        bind(peer_id=self.peer_id.to_base58()[-8:])
        self._inner_pipe = WholeMessages(self._inner_pipe)  # type: ignore[has-type]  # hivemind's, untyped
        super().run()

    async def _declare_for_download_periodically(self) -> None:
        """Not at all. hivemind's averager declares itself a state donor under one DHT key every
        ``declare_state_period`` and at every change of its priority, each a search of the DHT (a find per
        node on the way), for its own loader, which reads that key to pick a donor. We pick donors from the
        progress records instead (``trainer.py``: the canonical params' holders), and those cost nothing
        more: at 6 peers the declarations were 5 finds and 2.5 stores per peer per 4 s round, 11% of its
        non-payload traffic (bench/utilization.py's wiretap)."""

    def get_current_state(self):
        # Runs in this (host) process, in hivemind's state-fetching thread, when a peer downloads our state.
        metadata, tensors = self._state_provider()
        return metadata, tensors, None

    async def _set_group_bits(self, group_bits: str, future: MPFuture):
        self._round = int(group_bits, 2)  # the round this peer averages in (round_group_bits)
        await super()._set_group_bits(group_bits, future)

    def expect_group(self, peers: Sequence[str], round: int, clients: Sequence[str] = ()) -> None:
        """The all-reduce of ``round`` is with ``peers`` (us included): its first attempt asks
        :func:`barrier_leader` to lead (:class:`BarrierLeaders`), and the group assembles as soon as all are
        in (hivemind's ``target_group_size``, which a leader otherwise only reaches by waiting out
        ``min_matchmaking_time``). ``clients``: those of ``peers`` in client mode, which never lead."""
        future = MPFuture()
        self._outer_pipe.send(("_expect_group", [sorted(peers), round, sorted(clients)], dict(future=future)))
        future.result(timeout=_PIPE_TIMEOUT_S)

    async def _expect_group(self, peers: list[str], round: int, clients: list[str], future: MPFuture) -> None:
        self._roster = (round, frozenset(peers))
        self._guard_matchmaking()
        # A roster too large for one group is left to hivemind's search, for groups of the configured size (not
        # the size of the last roster we named), each seating peers of this roster only.
        configured = self.matchmaking_kwargs["target_group_size"]
        self._matchmaking.target_group_size = min(len(peers), configured)
        if len(peers) <= configured:
            # A client takes no calls (hivemind registers no handlers for it): a group it was named to lead
            # never formed, and the round's first attempt was lost. Whether a peer is a client is its own
            # claim (its record's ``serves``), the same to every member.
            leaders = [p for p in peers if p not in clients] or peers
            leader = barrier_leader(leaders, round, rotating=self._agreed_groups)
            self._matchmaking.potential_leaders.name(PeerID.from_base58(leader))
        future.set_result(None)

    async def _step(self, *, step, future_for_init):
        self._guard_matchmaking()
        self._steps_begun = getattr(self, "_steps_begun", 0) + 1
        this_step = self._steps_begun
        try:
            return await super()._step(step=step, future_for_init=future_for_init)
        finally:
            # No group of ours is on its way any more: a groupmate's part that waits for one (_holds_group) gets
            # its answer (BAD_GROUP_ID) now, not half a sender's timeout later. hivemind sets this only once a
            # group is registered, and a step that ended without one (our matchmaking gave up as a leader's
            # group came) left every part of that group waiting 15 s before its sender could leave us out.
            # Unless a newer step began meanwhile (the trainer gave this one up at its deadline): its group
            # may be on its way.
            if this_step == self._steps_begun:
                self._pending_groups_registered.set()

    def _guard_matchmaking(self) -> None:
        """Never ask a peer we left out to lead our group, and let the barrier name groups (hivemind's
        matchmaking is made inside its run loop, so it is changed here, once)."""
        matchmaking = self._matchmaking
        if getattr(matchmaking, "_guarded", False):
            return
        old = matchmaking.potential_leaders
        matchmaking.potential_leaders = BarrierLeaders(
            old.peer_id, old.min_matchmaking_time, old.target_group_size
        )
        ask = matchmaking._request_join_group
        answers = matchmaking._servicer_type = _AnswersNoted(matchmaking._servicer_type)
        leaders = matchmaking.potential_leaders

        async def ask_unless_left_out(leader: PeerID):
            if self._left_out_now(leader):
                return None
            answers.forget()
            group, cancelled = None, False
            try:
                group = await ask(leader)
            except asyncio.CancelledError:
                cancelled = True
                raise
            finally:
                honest_wait_s = leaders.min_matchmaking_time + self.request_timeout
                if group is None and (
                    holder := answers.held_us(cancelled=cancelled, honest_wait_s=honest_wait_s)
                ):
                    self._leave_the_holder_out(holder)
            if group is None and answers.accepted and self.client_mode:
                await self._say_no_group()
            if group is None and answers.code in _REFUSED_FOR_GOOD:
                leaders.refused(leader, _REFUSED_FOR_GOOD[answers.code])
            return group

        matchmaking._request_join_group = ask_unless_left_out
        matchmaking._guarded = True

    def _leave_the_holder_out(self, leader: PeerID) -> None:
        """A leader accepted us and then sent no group: it held the stream open, or ended it without a word
        (a hostile leader; an honest one that crashed). Its groupmates cannot tell: asked again in the
        round's retry, a leader that holds everyone it accepts voided every attempt of the round (it leads
        about one round in N). Left out of the round's retry; a named search for it ends at once."""
        log.warning(
            "a leader accepted us and sent no group: leaving it out of the round's retry",
            leader=leader.to_base58(),
            round=self._round,
        )
        self._left_out.for_round(leader.to_base58(), self._round)
        self._matchmaking.potential_leaders.refused(leader, "accepted us and sent no group")

    async def _say_no_group(self) -> None:
        """A leader accepted us and then sent us no group (it withheld it, or we gave up a moment before it
        came): tell the round's other members, whose group may hold us. A member that is not a client would
        be called by its groupmates and answer that it holds no such group; a client takes no calls, so
        they would wait out a sender's timeout for its parts and take it for a staller (16 rounds). They
        leave it out of that attempt only (``Fault.ABSENT``), as for a member that answered. We wait for
        their answers before our next attempt: a late notice must not reach a group we joined after it."""
        if self._roster is None or self._roster[0] != self._round:
            return
        notice = averaging_pb2.AveragingData(group_id=no_group_notice(self._round))
        me = self.peer_id.to_base58()

        async def tell(peer: str) -> None:
            stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
            answers = await stub.rpc_aggregate_part(as_aiter(notice))
            async with contextlib.aclosing(answers):  # type: ignore[type-var]  # hivemind's, untyped
                await anext(answers)  # BAD_GROUP_ID: it has heard us

        others = [peer for peer in self._roster[1] if peer != me]
        log.info("the leader accepted us and sent no group: telling the round's members", round=self._round)
        results = await asyncio.gather(
            *(asyncio.wait_for(tell(peer), self._group_wait_s() + self.request_timeout) for peer in others),
            return_exceptions=True,
        )
        for peer, result in zip(others, results):
            if isinstance(result, BaseException):
                log.debug("a member did not hear that we hold no group", peer=peer, error=repr(result)[:200])

    def leave_out(
        self,
        peers: Sequence[str],
        round: float,
        weights: Mapping[str, float] | None = None,
        sealed: Mapping[str, Sealed] | None = None,
    ) -> None:
        """Never average with ``peers`` in ``round`` (``math.inf``: ever again, nor serve them our state):
        refuse them in matchmaking and in a group another leader formed. ``weights``: the weight each other
        peer counts with in ``round`` (a verifiable round's verdict), whatever it claims; ``sealed``: what
        each of them sealed about the parts it sends (reducers refuse any other part)."""
        future = MPFuture()
        kwargs = dict(
            peers=list(peers),
            round=round,
            weights=dict(weights or {}),
            sealed=dict(sealed or {}),
            future=future,
        )
        self._outer_pipe.send(("_leave_out", [], kwargs))
        future.result(timeout=_PIPE_TIMEOUT_S)

    async def _leave_out(
        self, peers: list[str], round: float, weights: dict, sealed: dict, future: MPFuture
    ) -> None:
        try:
            for peer in peers:
                if round == math.inf:  # a ban: the swarm's reputation's, which a realignment may lift
                    self._left_out.ban(peer)
                else:
                    self._left_out.for_round(peer, int(round))
            if weights:
                self._weights = {r: w for r, w in self._weights.items() if r >= round - 1}  # the current ones
                self._weights[int(round)] = weights
            if sealed:
                self._sealed = {r: w for r, w in self._sealed.items() if r >= round - 1}
                self._sealed[int(round)] = sealed
        except BaseException as e:
            future.set_exception(e)
            raise
        future.set_result(None)

    def unban(self, peers: Sequence[str]) -> None:
        """Lift a ban (``leave_out(peers, math.inf)``) from ``peers``; faults we saw ourselves stand."""
        future = MPFuture()
        self._outer_pipe.send(("_unban", [], dict(peers=list(peers), future=future)))
        future.result(timeout=_PIPE_TIMEOUT_S)

    async def _unban(self, peers: list[str], future: MPFuture) -> None:
        for peer in peers:
            self._left_out.unban(peer)
        future.set_result(None)

    def left_out_of(self, peers: Sequence[str], round: int) -> list[str]:
        """Those of ``peers`` we do not average with in ``round``: faults we saw (a stall, a held or voided
        attempt, misbehaviour), bans, a verifiable round's verdict."""
        future = MPFuture()
        self._outer_pipe.send(("_left_out_of", [list(peers), round], dict(future=future)))
        return future.result(timeout=_PIPE_TIMEOUT_S)

    async def _left_out_of(self, peers: list[str], round: int, future: MPFuture) -> None:
        future.set_result(sorted(p for p in peers if self._excludes(p, round)))

    def _left_out_now(self, peer: PeerID) -> bool:
        return self._excludes(peer.to_base58(), self._round)

    def _excludes(self, peer: str, round: int) -> bool:
        if self._left_out.excludes(peer, round):
            return True
        # A verifiable round's verdict names everyone who counts: a peer it did not judge does not count.
        verdict = self._weights.get(round)
        return verdict is not None and peer != self.peer_id.to_base58() and peer not in verdict

    def _on_fault(self, peer: PeerID, fault: Fault, reason: str) -> None:
        refused_at = self._refused_at.get(peer.to_base58(), -math.inf)
        if fault == Fault.STALLED and time.monotonic() - refused_at < _REFUSAL_MEMORY_S:
            return  # it did not stall: we refused it (hivemind then counts it as a sender that never came)
        until = self._left_out.fault(peer.to_base58(), fault, self._round)
        if until < self._round:
            log.info(
                "a groupmate declined our group, as an honest one would that left out who misbehaved in it",
                peer=peer.to_base58(),
                round=self._round,
            )
            return
        log.warning(
            "left a groupmate out",
            peer=peer.to_base58(),
            fault=fault.value,
            reason=reason,
            round=self._round,
            until_round="the end of the run" if until == math.inf else int(until),
        )

    def _as_agreed(self, group_info: GroupInfo) -> GroupInfo:
        """The group under the id we average with: :func:`agreed_group`'s (``averaging.agreed_groups``)."""
        return agreed_group(group_info) if self._agreed_groups else group_info

    @contextlib.contextmanager
    def _register_allreduce_group(self, group_info):
        """hivemind's registration of the group we are about to average with (under :meth:`_as_agreed`'s id);
        its members are groupmates (admitted by ``_admit``) from this moment, before our all-reduce starts."""
        group_info = self._as_agreed(group_info)
        group_id = group_info.group_id
        self._grouped_round = self._round
        self._groupmates[group_id] = set(group_info.peer_ids)
        self._held_ids.append(group_id)
        try:
            with super()._register_allreduce_group(group_info):
                try:
                    yield
                finally:
                    # Given up before our runner was made (a groupmate we left out, a malformed join): hivemind
                    # drops the future unresolved, and a groupmate's part that waits on it would wait until
                    # its sender took us for a staller. It is answered BAD_GROUP_ID (rpc_aggregate_part).
                    future = self._running_groups.get(group_id)
                    if future is not None and not future.done():
                        future.set_exception(NotInGroup("the group was given up"))
                        future.exception()  # retrieved: nobody need wait on it
        finally:
            self._groupmates.pop(group_id, None)
            self._absent_early.pop(group_id, None)

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        formed = time.monotonic()
        self._last_allreduce = _Outcome()
        # A group that another leader formed may hold a peer we left out: never average with it.
        excluded = [p for p in group_info.peer_ids if self._left_out_now(p)]
        if excluded:
            raise AllreduceException(
                f"the group holds {excluded[0]}, whom we left out of round {self._round}"
            )
        try:
            group_info = checked_group(self._as_agreed(group_info), self.peer_id, self.mode, self.serializer)
        except MalformedJoin as e:
            if e.peer != self.peer_id:  # ours, malformed, is the leader's doing: we know what we sent
                self._on_fault(e.peer, Fault.MALFORMED_JOIN, str(e))
            # hivemind pickles the step's error to the trainer's process: one that unpickles as it pickled.
            raise AllreduceException(str(e)) from None
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        self._last_allreduce.refused = self._left_out.for_good()
        self._last_allreduce.stalled = self._left_out.for_a_while(self._round)
        self._last_allreduce.allreduce_s = time.monotonic() - formed
        return {"gathered": gathered, "outcome": self._last_allreduce}

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        runner = self._make_runner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            **kwargs,
        )
        assert group_id in self._running_groups, f"group {group_id} was not registered"
        self._running_groups[group_id].set_result(runner)
        for peer in self._absent_early.pop(group_id, ()):
            await runner.mark_absent(peer, "it holds another group, or took our answer that we held none")
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("auxiliary peers do not receive averages")
            return
        async for tensor, averaged in azip(as_aiter(*tensors), runner):
            tensor.copy_(averaged)
        self._last_allreduce = _Outcome(
            runner.bytes_sent,
            runner.bytes_received,
            dropped=sorted(p.to_base58() for p in runner.banned_senders),
            outliers={  # our own part may be the outlier too (then we were wrong): never a suspect here
                runner.sender_peer_ids[sender].to_base58(): parts
                for sender, parts in runner.tensor_part_reducer.parts_left_out.items()
                if runner.sender_peer_ids[sender] != self.peer_id
            },
        )
        if runner.tensor_part_container.failed_size:
            raise AllreduceException(
                f"a reducer left mid-way; {runner.tensor_part_container.failed_size} values were not averaged"
            )
        if runner.misbehaved:
            # Its parts were left out of our slice, but as a reducer it may have returned anything for its
            # own slice (a claimed weight of 1e9 gives a finite, well-shaped, poisoned answer): the retry
            # goes without it.
            raise AllreduceException(
                f"{sorted(map(str, runner.misbehaved))[0]} misbehaved: this average is void"
            )

    def _make_runner(self, **kwargs) -> ExactAllReduceRunner:
        """The runner of one all-reduce (tests subclass this to fail at a chosen moment)."""
        return ExactAllReduceRunner(
            max_weight=self._max_weight,
            weights=self._weights.get(self._round),
            sealed=self._sealed.get(self._round),
            aggregate=self._aggregate,
            on_fault=self._on_fault,
            **kwargs,
        )

    def download_state_from(self, peers: Sequence[str], timeout: float) -> tuple[str, Any, list] | None:
        """Download ``get_current_state`` of the first of ``peers`` (base58 ids) that serves it.

        Returns (peer id, metadata, tensors), or None if none of them did within ``timeout`` each.
        """
        future = MPFuture()
        self._outer_pipe.send(
            ("_download_state_from", [], dict(peers=list(peers), timeout=timeout, future=future))
        )
        try:
            return future.result(timeout=len(peers) * timeout + _GRACE_S)
        except concurrent.futures.TimeoutError:  # the answer was lost on the way: as if nobody served it
            log.warning("no answer from the averager about a state download", donors=len(peers))
            return None

    async def _download_state_from(self, peers: list[str], timeout: float, future: MPFuture) -> None:
        try:
            for peer_b58 in peers:
                peer = PeerID.from_base58(peer_b58)
                if peer == self.peer_id:
                    continue
                try:
                    metadata, tensors = await asyncio.wait_for(self._download_one(peer), timeout)
                except Exception as e:  # donor left, timed out or sent garbage: try the next one
                    log.warning("state download failed", donor=peer_b58, error=repr(e))
                    continue
                if metadata is None:
                    continue
                try:  # it crosses a pipe: what cannot (deep nesting, a RecursionError) would leave it unsent
                    pickle.dumps(metadata)
                except Exception as e:
                    log.warning(
                        "state download failed", donor=peer_b58, error=f"unusable metadata ({e!r:.80})"
                    )
                    continue
                future.set_result((peer_b58, metadata, tensors))
                return
        finally:
            if not future.done():
                future.set_result(None)

    async def _download_one(self, peer: PeerID):
        stub = self.get_stub(self._p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        metadata: Any = None
        parts: list = []
        tensors: list[torch.Tensor] = []
        received = 0
        async for message in stream:
            # A donor is a stranger: never take more than a state of this model can weigh.
            received += len(message.metadata) + len(message.tensor_part.buffer)
            if received > self._max_state_bytes:
                raise ValueError(
                    f"{peer} sent more than {self._max_state_bytes} bytes: not a state of this model"
                )
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a dtype marks the first part of the next tensor
                tensors.append(_state_tensor(combine_from_streaming(parts), peer))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(_state_tensor(combine_from_streaming(parts), peer))
        return metadata, tensors


def _state_tensor(whole: runtime_pb2.Tensor, donor: PeerID) -> torch.Tensor:
    """A tensor of a donated state, as every donor sends it: float32 values as they are (hivemind's
    ``state_compression``, none). Nothing else is decoded: a codec or a wider dtype would make of the bytes
    a donor may send (``max_state_bytes``) many times as many in memory."""
    if whole.compression != runtime_pb2.CompressionType.NONE or whole.dtype != "float32":
        raise ValueError(
            f"{donor} sent a tensor that is not float32 values as they are: not a state of this model"
        )
    if len(whole.buffer) < 4 * math.prod(whole.size):
        raise ValueError(f"{donor} sent a truncated tensor (its stream ended early: it left, or was cut off)")
    if len(whole.buffer) > 4 * math.prod(whole.size):
        raise ValueError(
            f"{donor} sent a tensor of more bytes than its shape holds: not a state of this model"
        )
    return deserialize(whole)


class SwarmAverager:
    """The :class:`p2ptrain.diloco.Averager` of a real swarm: one hivemind averager per peer, one group per
    round; it also downloads the swarm's state from a chosen donor.

    Args:
        layout: where the pseudo-gradient's tensors go on the wire (``compression.layout_for``): the wire
            tensors this averager holds, their codec and the part size.
        state_provider: what we serve to a newcomer (``transfer.donation``); runs in a thread of this process.
        max_weight: the most samples one peer can process in a round; a groupmate that claims a larger (or a
            non-positive, or non-finite) weight is left out.
        stop: set it to cancel an all-reduce in progress.
        averager_cls: tests pass a subclass that fails at a chosen moment.
    """

    def __init__(
        self,
        dht,
        *,
        run_id: str,
        layout: Layout,
        cfg: AveragingConfig,
        client_mode: bool,
        state_provider: Callable[[], tuple[dict, list[torch.Tensor]]],
        max_weight: float = math.inf,
        stop: threading.Event | None = None,
        averager_cls: type[ExactAverager] = ExactAverager,
    ):
        self.cfg = cfg
        self.stop = stop or threading.Event()
        # Averaged tensors must be CPU shared memory: the averager child reads and writes them.
        self.layout = layout
        self.buffers = [torch.zeros(shape, dtype=torch.float32) for shape in layout.wire_shapes]
        self.peer_id = dht.peer_id.to_base58()
        with keep_sigint_handler():
            self._averager = averager_cls(
                self.buffers,
                dht,
                prefix=f"{run_id}_diloco",
                run_id=run_id,
                max_weight=max_weight,
                aggregate=aggregator(cfg),
                agreed_groups=cfg.agreed_groups,
                # Params and outer momentum in float32, hivemind's framing, and room for the metadata (the
                # reputation, and in a verifiable run the disputes still to settle).
                max_state_bytes=2 * 4 * sum(math.prod(s) for s in layout.shapes) * 1.1
                + 2**16
                + MAX_DONATED_DISPUTE_BYTES,
                start=True,
                state_provider=state_provider,
                target_group_size=cfg.target_group_size,
                min_group_size=cfg.min_group_size,
                min_matchmaking_time=cfg.matchmaking_time_s,
                request_timeout=cfg.request_timeout_s,
                allreduce_timeout=cfg.allreduce_timeout_s,
                next_chunk_timeout=cfg.next_chunk_timeout_s,
                compression=layout.codec,
                part_size_bytes=layout.part_size_bytes,  # the cut that verify.wire seals
                client_mode=client_mode,
                allow_state_sharing=not client_mode,
                shutdown_timeout=5,
            )

    def average(
        self, tensors: Sequence[torch.Tensor], *, weight: float, round: int, attempts: int | None = None
    ) -> AverageResult:
        errors = []
        for attempt in range(1 + self.cfg.retries if attempts is None else attempts):
            with self._averager.get_tensors() as buffers:
                self.layout.pack(tensors, out=buffers)
            self._averager.set_group_bits(round_group_bits(round))
            t0 = time.monotonic()
            try:
                out = self._step(weight, round)
            except _Stopped:
                raise AveragingFailed("stopped", "stop requested") from None
            except Exception as e:  # hivemind raises its own zoo here (Allreduce, Matchmaking, P2P errors)
                errors.append(f"attempt {attempt + 1}: {_short(e)}")
                log.info(
                    "averaging attempt failed",
                    round=round,
                    attempt=attempt + 1,
                    error=_short(e),
                    seconds=round_s(time.monotonic() - t0),
                )
                continue
            if out is None:
                errors.append(f"attempt {attempt + 1}: no group")
                continue
            gathered = out["gathered"]
            # What groupmates sent about themselves (checked_group cut it down to their round).
            infos = [g if isinstance(g, dict) else {} for g in gathered.values()]
            rounds = {g.get("round") for g in infos}
            if rounds != {round}:  # cannot happen with round-keyed groups; never apply a mixed average
                errors.append(f"attempt {attempt + 1}: groupmates of rounds {sorted(map(str, rounds))}")
                continue
            with self._averager.get_tensors() as buffers:
                averaged = self.layout.unpack(buffers)
            # Who averaged: the group's peer ids (each member's own, as the transport knows it), never the
            # id a member wrote into its data (one that names another would vouch that it averaged).
            peers = sorted(p.to_base58() for p in gathered)
            outcome: _Outcome = out["outcome"]
            contributors = [p for p in peers if p not in outcome.dropped]
            step_s = time.monotonic() - t0
            return AverageResult(
                tensors=averaged,
                group_size=len(contributors),
                bytes_sent=outcome.bytes_sent,
                bytes_received=outcome.bytes_received,
                peers=contributors,
                outliers=outcome.outliers,
                refused=list(outcome.refused),
                stalled=list(outcome.stalled),
                matchmaking_s=max(0.0, step_s - outcome.allreduce_s),
                allreduce_s=outcome.allreduce_s,
            )
        reason = (
            "no_group"
            if all("no group" in e or "could not find a group" in e for e in errors)
            else "allreduce"
        )
        raise AveragingFailed(reason, "; ".join(errors))

    def _step(self, weight: float, round: int):
        control = self._averager.step(
            weight=float(weight),
            gather={"round": round},
            timeout=self.cfg.matchmaking_timeout_s,
            allow_retries=False,
            wait=False,
        )
        # hivemind ends a step within these; past them (with room for a busy machine) the averager's answer
        # is lost, and waiting on would hang the round.
        deadline = time.monotonic() + self.cfg.matchmaking_timeout_s + self.cfg.allreduce_timeout_s + _GRACE_S
        # Poll rather than block, so that SIGINT/SIGTERM can cancel an all-reduce in progress.
        while True:
            try:
                return control.result(timeout=_POLL_S)
            except concurrent.futures.TimeoutError:
                if self.stop.is_set():
                    control.cancel()
                    raise _Stopped() from None
                if time.monotonic() > deadline:
                    control.cancel()
                    raise AllreduceException("the averager gave no answer in time") from None

    def leave_out(
        self,
        peers: Sequence[str],
        round: int,
        weights: Mapping[str, float] | None = None,
        sealed: Mapping[str, Sealed] | None = None,
    ) -> None:
        self._averager.leave_out(peers, round, weights, sealed)

    def ban(self, peers: Sequence[str]) -> None:
        self._averager.leave_out(peers, math.inf)

    def unban(self, peers: Sequence[str]) -> None:
        self._averager.unban(peers)

    def left_out_of(self, peers: Sequence[str], round: int) -> list[str]:
        return self._averager.left_out_of(peers, round)

    def expect_group(self, peers: Sequence[str], round: int, clients: Sequence[str] = ()) -> None:
        """The all-reduce of ``round`` is with ``peers``, as the barrier knows them (us included): its first
        attempt needs no search of the DHT and ends once they are all in, rather than waiting out a timer. A
        group larger than ``averaging.target_group_size`` is left to hivemind's search. ``clients``: those of
        ``peers`` in client mode (they take no calls, so none of them leads)."""
        self._averager.expect_group(peers, round, clients)

    def download_state(self, donors: Sequence[str], timeout: float):
        return self._averager.download_state_from(donors, timeout)

    def shutdown(self) -> None:
        if self._averager.is_alive():
            self._averager.shutdown()


def round_s(seconds: float) -> float:
    return round(seconds, 3)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1]}" if text else type(e).__name__
