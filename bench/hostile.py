"""A hostile peer, built only from hivemind's and p2ptrain's own code, for the attack benchmark
(bench/attacks.py) and the tests: what an insider (it holds the swarm key) or an outsider can send.

    python -m bench.hostile ATTACK --config configs/tiny.yaml --initial-peers ADDR --key-file KEY \
        --run-id RUN [--seconds 600]

Attacks (the hostile-peer issue's numbering):
  weight      joins every round's all-reduce claiming a weight of 1e9 samples, sending small noise
  nan         joins every round's all-reduce sending NaN
  fake_round  publishes a record one round ahead of the swarm and serves garbage params (checksum right)
  download    an outsider (no key, no record) tries to join the DHT and to download the state
  no_peer     joins every round's all-reduce with an all-gather entry that lacks the `peer` field
  shadow      publishes records in the honest peers' names, and a record of its own, then leaves
  stall       joins every round's all-reduce and never sends
  hold        accepts every join request as a leader and then sends nothing (neither the group nor a
              disband), searching for a group all round long
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import typing
from pathlib import Path

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2

from p2ptrain.averaging import ExactAllReduceRunner, ExactAverager, SwarmAverager, round_group_bits
from p2ptrain.compression import layout_for
from p2ptrain.config import load_config, parse_set
from p2ptrain.diloco import AveragingFailed, DiLoCo, Snapshot
from p2ptrain.models import build_model
from p2ptrain.records import PeerState, ProgressRecord
from p2ptrain.transfer import donation

ATTACKS = ("weight", "nan", "fake_round", "download", "no_peer", "shadow", "stall", "hold")


class NeverSends(ExactAllReduceRunner):
    """Joins the group, then sends nothing and answers nothing, while staying connected."""

    async def _communicate_with_peer(self, peer_id):
        await asyncio.sleep(3600)

    async def rpc_aggregate_part(self, stream, context):
        await asyncio.sleep(3600)
        yield  # never reached: an async generator, as hivemind's handler is


class Staller(ExactAverager):
    def _make_runner(self, **kwargs) -> ExactAllReduceRunner:
        return NeverSends(**kwargs)


class Holder(ExactAverager):
    """As a leader (the barrier named it, or a search found it), accepts every join request and then holds
    the stream open, sending nothing more: hivemind's leader sends the group or disbands it by its
    expiration."""

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.MessageFromLeader]:  # hivemind registers handlers by these
        yield averaging_pb2.MessageFromLeader(code=averaging_pb2.ACCEPTED)
        await asyncio.sleep(3600)


# hivemind names RPC handlers "<class name>.<method>": a stand-in keeps the name of the class it replaces.
Staller.__name__ = Holder.__name__ = ExactAverager.__name__


def say(**event) -> None:
    print(json.dumps({"hostile": True, **event}), flush=True)


def honest_round(records: dict[str, ProgressRecord], me: str) -> int:
    rounds = [r.round for pid, r in records.items() if pid != me and r.holds_params]
    return max(rounds, default=-1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("attack", choices=ATTACKS)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--initial-peers", action="append", required=True)
    parser.add_argument("--key-file", type=Path, required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--seconds", type=float, default=600)
    args = parser.parse_args(argv)
    sets = [f"run.run_id={args.run_id}"]
    cfg = load_config(args.config, overrides=parse_set(sets))
    cfg.swarm.initial_peers = list(args.initial_peers)
    cfg.swarm.host_maddrs = ["/ip4/127.0.0.1/tcp/0"]
    if args.attack == "download":
        outsider(cfg)
        return
    cfg.swarm.key_file = args.key_file
    insider(args.attack, cfg, deadline=time.monotonic() + args.seconds)


def outsider(cfg) -> None:
    """No key: the DHT refuses it; a direct download from a member's averager is refused too."""
    from hivemind.p2p import P2P, P2PHandlerError, PeerID

    from p2ptrain.addrs import SwarmError
    from p2ptrain.swarm import create_dht

    try:
        create_dht(cfg.swarm)
        say(attack="download", dht="joined")
    except SwarmError as e:
        say(attack="download", dht="refused", error=str(e))

    async def download() -> str:
        p2p = await P2P.create(initial_peers=cfg.swarm.initial_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            target = PeerID.from_base58(cfg.swarm.initial_peers[0].rsplit("/p2p/", 1)[1])
            stub = ExactAverager.get_stub(p2p, target, namespace=f"{cfg.run.run_id}_diloco")
            try:
                async for message in await stub.rpc_download_state(averaging_pb2.DownloadRequest()):
                    if message.tensor_part.buffer:
                        return "served"
                return "nothing served"
            except P2PHandlerError as e:
                return f"refused: {str(e)[-160:]}"
        finally:
            await p2p.shutdown()

    say(attack="download", state=asyncio.run(download()))


def insider(attack: str, cfg, deadline: float) -> None:
    from p2ptrain.swarm import Swarm

    board = Swarm(cfg.run.run_id, cfg.swarm, device="cpu")
    model = build_model(cfg.model.name, cfg.model.context_length)
    shapes = [p.shape for p in model.parameters() if p.requires_grad]
    diloco = DiLoCo(model, lr=cfg.outer.lr, momentum=cfg.outer.momentum, nesterov=cfg.outer.nesterov)
    garbage = [p * 0 + 100.0 for p in diloco.master]
    fake_round = [0]

    def serve_garbage():
        snapshot = Snapshot(
            round=fake_round[0], params=garbage, momentum=diloco.momentum_buffers(), residuals=[]
        )
        return donation(snapshot, run_id=cfg.run.run_id, config_hash=cfg.training_hash())

    averager = SwarmAverager(
        board.dht,
        run_id=cfg.run.run_id,
        layout=layout_for(shapes, cfg.averaging),
        # One attempt a round, given up soon: a round it missed (the honest peers passed their barrier before
        # its record came) must not keep it from the next ones.
        cfg=cfg.averaging.model_copy(update={"retries": 0, "matchmaking_timeout_s": 4.0}),
        client_mode=False,
        state_provider=serve_garbage,
        stop=threading.Event(),
        averager_cls={"stall": Staller, "hold": Holder}.get(attack, ExactAverager),
    )
    # A record at once, paused (nobody waits for it): the honest peers (swarm.min_peers counts it) start the
    # run with it there and push it their records, so that it sees every round as it comes. Without it, it
    # learnt of rounds from the DHT only, after the short runs of the benchmark had ended.
    board.update(state=PeerState.PAUSED)
    board.publish()
    say(attack=attack, peer_id=board.peer_id, started=True)
    try:
        if attack == "shadow":
            shadow(board, deadline)
            return
        last = -1
        while time.monotonic() < deadline:
            records = board.records()
            r = honest_round(records, board.peer_id)
            if r < 0:
                time.sleep(0.02)
                continue
            if attack == "fake_round":
                fake_round[0] = r + 1
                board.update(
                    round=r + 1, state=PeerState.TRAINING, params_hash=serve_garbage()[0]["params_hash"]
                )
                board.publish()
                time.sleep(0.3)
                continue
            if r == last:  # one attempt per round
                time.sleep(0.02)
                continue
            last = r
            canon = next(
                (x.params_hash for pid, x in records.items() if pid != board.peer_id and x.round == r), ""
            )
            # As p2ptrain's barrier does: the round's group is every peer of the round, led by the peer it names,
            # and it says so in its record (averaging.settled_groups), as it turns ready.
            roster = sorted(
                {pid for pid, x in records.items() if x.round == r and x.holds_params} | {board.peer_id}
            )
            board.update(round=r, state=PeerState.AVERAGING, params_hash=canon, group=roster)
            board.publish()
            averager.expect_group(roster, r)
            noise = [torch.randn(s) * 1e-3 for s in shapes]
            try:
                if attack == "weight":
                    averager.average(noise, weight=1e9, round=r)
                elif attack == "nan":
                    averager.average([torch.full(s, float("nan")) for s in shapes], weight=1.0, round=r)
                elif attack == "stall":
                    averager.average(noise, weight=1.0, round=r)
                elif attack == "hold":
                    # It searches all round long, so that a retry of the round finds it declared in the DHT.
                    while honest_round(board.records(), board.peer_id) == r and time.monotonic() < deadline:
                        try:
                            averager.average(noise, weight=1.0, round=r)
                        except AveragingFailed as e:
                            say(attack=attack, round=r, outcome=type(e).__name__, error=str(e)[-200:])
                elif attack == "no_peer":
                    with averager._averager.get_tensors() as buffers:
                        averager.layout.pack(noise, out=buffers)
                    averager._averager.set_group_bits(round_group_bits(r))
                    averager._averager.step(
                        weight=1.0, gather={"round": r}, timeout=cfg.averaging.matchmaking_timeout_s
                    )
                say(attack=attack, round=r, outcome="averaged")
            except Exception as e:  # refused, left out or timed out: what the attack is about
                say(attack=attack, round=r, outcome=type(e).__name__, error=str(e)[-200:])
    finally:
        averager.stop.set()
        averager.shutdown()
        board.shutdown(say_goodbye=False)


def shadow(board, deadline: float) -> None:
    """Records in the honest peers' names (signed with our key), and one of our own that we then abandon."""
    me = board.peer_id
    while time.monotonic() < deadline:
        records = board.records()
        r = honest_round(records, me)
        honest = [pid for pid in records if pid != me]
        if r >= 1 and honest:
            for victim in honest:  # a record in the victim's name, far ahead, said to be fresh
                board.peer_id = victim
                board.update(round=r, state=PeerState.TRAINING, params_hash="")
                board.publish()
            board.peer_id = me
            board.update(round=r, state=PeerState.TRAINING, params_hash="")  # our own, never ready
            board.publish()
            say(attack="shadow", round=r, victims=len(honest), outcome="published, leaving")
            board.dht.shutdown()  # leave without a goodbye: the record stays until it expires
            return
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main())
