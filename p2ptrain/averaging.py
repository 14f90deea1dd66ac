"""Pseudo-gradient averaging over hivemind's decentralized all-reduce.

Three changes to hivemind 1.1.12's averager, each for a reason:

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

It also counts the payload bytes each peer sends and receives, and lets the trainer download the
swarm's state from a donor of its choosing (the checks on what arrives are in ``transfer.py``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllreduceException, AllReduceRunner, AveragingMode
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import CompressionBase
from hivemind.compression.serialization import combine_from_streaming
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import (
    aiter_with_timeout,
    amap_in_executor,
    as_aiter,
    attach_event_on_finished,
    azip,
)

from p2ptrain.compression import deserialize
from p2ptrain.config import AveragingConfig
from p2ptrain.diloco import AverageResult, AveragingFailed
from p2ptrain.logs import get_logger, unbind
from p2ptrain.membership import Throttle
from p2ptrain.procs import ParentWatchdog, keep_sigint_handler
from p2ptrain.records import live
from p2ptrain.swarm import progress_key, records_from_dht_value

log = get_logger(__name__)

_POLL_S = 0.25
_MEMBERS_MAX_AGE_S = 10.0
"""Read the run's records again at most this long after the last read (peers that left lose the door)..."""
_MEMBERS_MIN_AGE_S = 1.0
"""...and at least this long after it (an unknown caller may be a newcomer whose record just arrived)."""


class _Stopped(Exception):
    pass


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
        on_part_served: Callable[[], None] | None = None,
        **kwargs,
    ):
        self._on_part_served = on_part_served
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
        self.parts_for_local_averaging = self.tensor_part_container.get_raw_input_parts(my_index)
        self._serialized_averages: dict[int, asyncio.Future] = {}
        self.bytes_sent = 0
        self.bytes_received = 0

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
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged_part = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight
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

            def _deserialize(msg):
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                self.bytes_received += len(msg.tensor_part.buffer)
                return deserialize(msg.tensor_part)

            part_index = 0
            async for averaged in amap_in_executor(
                _deserialize,
                aiter_with_timeout(stream, self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged)
                part_index += 1
            if part_index != self.tensor_part_container.num_parts_by_peer[peer_index]:
                raise AllreduceException(
                    f"peer {peer_id} sent {part_index} parts, expected "
                    f"{self.tensor_part_container.num_parts_by_peer[peer_index]}"
                )
        except BaseException:
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _generate_input_for_peer(self, peer_index: int):
        async for msg in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += len(msg.tensor_part.buffer)
            yield msg

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        part_index = 0
        try:
            async for tensor_part, weight in amap_in_executor(
                lambda msg: (self._count_received(msg), msg.weight),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                except Exception as e:  # BannedException: this sender was dropped, stop serving it
                    log.debug("sender dropped", sender_index=sender_index, error=repr(e))
                    break
                serialized = await self._serialized_average(part_index, averaged_part)
                part_index += 1
                self.bytes_sent += len(serialized.buffer)
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                if self._on_part_served is not None:
                    self._on_part_served()
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def _count_received(self, msg) -> torch.Tensor:
        self.bytes_received += len(msg.tensor_part.buffer)
        return deserialize(msg.tensor_part)


class ExactAverager(ParentWatchdog, DecentralizedAverager):
    """hivemind's DecentralizedAverager with exact all-reduce, byte counts, chosen donors, a watchdog, and
    a door: only members of the run may call it.

    hivemind authorizes no averaging RPC. Here joining a group, sending a part and downloading the state
    are refused to a caller (its libp2p id, which the transport authenticates) that has no live progress
    record of the run: with a swarm key only key holders can write one (``membership.py``).
    """

    def __init__(
        self, *args, run_id: str, state_provider: Callable[[], tuple[dict, list[torch.Tensor]]], **kwargs
    ):
        self._watched_parent_pid = os.getpid()
        self._state_provider = state_provider
        self._run_id = run_id
        self._members: set[str] = set()
        self._members_read_at = -float("inf")
        self._members_lock: asyncio.Lock | None = None
        self._refused = Throttle()
        super().__init__(*args, **kwargs)

    async def _admit(self, remote: PeerID, rpc: str) -> None:
        """Raise PermissionError (which hivemind sends back to the caller) unless ``remote`` is a member."""
        peer = remote.to_base58()
        if self._members_lock is None:  # made in this (the averager's) process and event loop
            self._members_lock = asyncio.Lock()
        async with self._members_lock:  # a caller that comes during a read waits for its result
            age = time.monotonic() - self._members_read_at
            if age > _MEMBERS_MAX_AGE_S or (peer not in self._members and age > _MEMBERS_MIN_AGE_S):
                found = await self.dht.get(progress_key(self._run_id), latest=True, return_future=True)
                self._members = set(live(records_from_dht_value(found)))
                self._members_read_at = time.monotonic()
            if peer in self._members:
                return
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

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:  # hivemind reads these: typing's, not abc's
        await self._admit(context.remote_id, "to let it join a group")
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(
        self, stream: typing.AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.AveragingData]:
        await self._admit(context.remote_id, "to average its part")
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:
        await self._admit(context.remote_id, "to send it the state")
        async for message in super().rpc_download_state(request, context):
            yield message

    def run(self) -> None:
        self._start_parent_watchdog(lambda: self._outer_pipe.send(("_shutdown", [self.shutdown_timeout], {})))
        # If the parent created torch's thread pool before forking us (torch.set_num_threads does), the first
        # use in this child replaces the inherited pool, and two threads doing that at once race: one sees
        # no pool and fails with "Invalid thread pool!", silently stalling that all-reduce until groupmates
        # time us out. Replace it here, once, before any worker thread exists.
        torch.set_num_threads(torch.get_num_threads())
        unbind("round")  # inherited at fork time; this process does not follow the trainer's rounds
        super().run()

    def get_current_state(self):
        # Runs in this (host) process, in hivemind's state-fetching thread, when a peer downloads our state.
        metadata, tensors = self._state_provider()
        return metadata, tensors, None

    async def _aggregate_with_group(self, group_info, min_vector_size: int, **kwargs):
        self._last_bytes = (0, 0)
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        sent, received = self._last_bytes
        return {"gathered": gathered, "bytes_sent": sent, "bytes_received": received}

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
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("auxiliary peers do not receive averages")
            return
        async for tensor, averaged in azip(as_aiter(*tensors), runner):
            tensor.copy_(averaged)
        self._last_bytes = (runner.bytes_sent, runner.bytes_received)
        if runner.tensor_part_container.failed_size:
            raise AllreduceException(
                f"a reducer left mid-way; {runner.tensor_part_container.failed_size} values were not averaged"
            )

    def _make_runner(self, **kwargs) -> ExactAllReduceRunner:
        """The runner of one all-reduce (tests subclass this to fail at a chosen moment)."""
        return ExactAllReduceRunner(**kwargs)

    def download_state_from(self, peers: Sequence[str], timeout: float) -> tuple[str, Any, list] | None:
        """Download ``get_current_state`` of the first of ``peers`` (base58 ids) that serves it.

        Returns (peer id, metadata, tensors), or None if none of them did within ``timeout`` each.
        """
        future = MPFuture()
        self._outer_pipe.send(
            ("_download_state_from", [], dict(peers=list(peers), timeout=timeout, future=future))
        )
        return future.result()

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
                if metadata is not None:
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
        async for message in stream:
            if message.metadata:
                metadata = self.serializer.loads(message.metadata)
            if message.tensor_part.dtype and parts:  # a dtype marks the first part of the next tensor
                tensors.append(deserialize(combine_from_streaming(parts)))
                parts = []
            parts.append(message.tensor_part)
        if parts:
            tensors.append(deserialize(combine_from_streaming(parts)))
        return metadata, tensors


class SwarmAverager:
    """The :class:`p2ptrain.diloco.Averager` of a real swarm: one hivemind averager per peer, one group per
    round; it also downloads the swarm's state from a chosen donor.

    Args:
        codec: the wire format; the same object error feedback rounds with, so that what it keeps is
            exactly what this averager's wire drops.
        state_provider: what we serve to a newcomer (``transfer.donation``); runs in a thread of this process.
        stop: set it to cancel an all-reduce in progress.
        averager_cls: tests pass a subclass that fails at a chosen moment.
    """

    def __init__(
        self,
        dht,
        *,
        run_id: str,
        shapes: Sequence[torch.Size],
        cfg: AveragingConfig,
        codec: CompressionBase,
        client_mode: bool,
        state_provider: Callable[[], tuple[dict, list[torch.Tensor]]],
        stop: threading.Event | None = None,
        averager_cls: type[ExactAverager] = ExactAverager,
    ):
        self.cfg = cfg
        self.stop = stop or threading.Event()
        # Averaged tensors must be CPU shared memory: the averager child reads and writes them.
        self.buffers = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        self.peer_id = dht.peer_id.to_base58()
        with keep_sigint_handler():
            self._averager = averager_cls(
                self.buffers,
                dht,
                prefix=f"{run_id}_diloco",
                run_id=run_id,
                start=True,
                state_provider=state_provider,
                target_group_size=cfg.target_group_size,
                min_group_size=cfg.min_group_size,
                min_matchmaking_time=cfg.matchmaking_time_s,
                request_timeout=cfg.request_timeout_s,
                allreduce_timeout=cfg.allreduce_timeout_s,
                next_chunk_timeout=cfg.next_chunk_timeout_s,
                compression=codec,
                client_mode=client_mode,
                allow_state_sharing=not client_mode,
                declare_state_period=10,
                shutdown_timeout=5,
            )

    def average(self, tensors: Sequence[torch.Tensor], *, weight: float, round: int) -> AverageResult:
        errors = []
        for attempt in range(1 + self.cfg.retries):
            with self._averager.get_tensors() as buffers:
                for buf, t in zip(buffers, tensors):
                    buf.copy_(t)
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
            # What groupmates sent about themselves: never trusted to be well formed.
            infos = [g if isinstance(g, dict) else {} for g in gathered.values()]
            rounds = {g.get("round") for g in infos}
            if rounds != {round}:  # cannot happen with round-keyed groups; never apply a mixed average
                errors.append(f"attempt {attempt + 1}: groupmates of rounds {sorted(map(str, rounds))}")
                continue
            with self._averager.get_tensors() as buffers:
                averaged = [b.clone() for b in buffers]
            return AverageResult(
                tensors=averaged,
                group_size=len(gathered),
                bytes_sent=out["bytes_sent"],
                bytes_received=out["bytes_received"],
                peers=sorted(str(g.get("peer", "?"))[:128] for g in infos),
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
            gather={"round": round, "peer": self.peer_id},
            timeout=self.cfg.matchmaking_timeout_s,
            allow_retries=False,
            wait=False,
        )
        # Poll rather than block, so that SIGINT/SIGTERM can cancel an all-reduce in progress.
        while True:
            try:
                return control.result(timeout=_POLL_S)
            except concurrent.futures.TimeoutError:
                if self.stop.is_set():
                    control.cancel()
                    raise _Stopped() from None

    def set_round(self, round: int) -> None:
        """Tell donors-to-be which round our state is (higher rounds are preferred by hivemind's loader)."""
        self._averager.state_sharing_priority = float(round)

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
