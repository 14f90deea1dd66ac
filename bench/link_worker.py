"""One side of bench.link's transfers, run inside a peer's namespace (or on loopback): both sides send the
same bytes to each other at once, three ways, and print a JSON line of seconds per transfer.

    python -m bench.link_worker tcp|gloo|hivemind --rank 0|1 --host ADDR --peer ADDR --bytes N --repeats K

- ``tcp``: a plain TCP socket each way (the link's own rate);
- ``gloo``: torch.distributed's all-reduce of an N-byte float32 tensor between the two ranks (a ring of two:
  each sends N bytes and receives N bytes, as a datacenter user's DDP would);
- ``hivemind``: p2ptrain's all-reduce of the same tensor (``averaging.SwarmAverager``, no compression): each
  peer sends half to the other's reducer and gets the averaged half back, N bytes each way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import threading
import time

import torch

PORT = 29517


def tcp(args) -> list[float]:
    """Both ranks send ``bytes`` to each other over one TCP connection at once; seconds until both are done."""
    if args.rank == 0:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((args.host, PORT))
        server.listen(1)
        conn, _ = server.accept()
    else:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = socket.create_connection((args.peer, PORT))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    payload = b"\0" * args.bytes
    times = []
    for _ in range(args.repeats):
        conn.sendall(b"g")  # both sides start together
        assert conn.recv(1) == b"g"
        t0 = time.perf_counter()
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        got = 0
        while got < args.bytes:
            got += len(conn.recv(min(1 << 20, args.bytes - got)))
        sender.join()
        times.append(time.perf_counter() - t0)
    conn.close()
    return times


def gloo(args) -> list[float]:
    import torch.distributed as dist

    master = args.host if args.rank == 0 else args.peer
    # gloo binds to the interface its host name resolves to unless told: in a namespace, the veth.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", args.ifname)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{PORT + 1}",
        rank=args.rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=60),
    )
    x = torch.ones(args.bytes // 4)
    dist.all_reduce(x)  # connects
    times = []
    for _ in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t0)
    return times


def hivemind(args) -> list[float]:
    from p2ptrain.averaging import SwarmAverager
    from p2ptrain.compression import layout_for
    from p2ptrain.config import AveragingConfig, SwarmConfig
    from p2ptrain.records import PeerState
    from p2ptrain.swarm import Swarm

    initial = [] if args.rank == 0 else [_read(args.maddr_file)]
    cfg = SwarmConfig(
        host_maddrs=[f"/ip4/{args.host}/tcp/0"],
        initial_peers=initial,
        nat_port_map=False,
        use_auto_relay=False,
    )
    board = Swarm("link", cfg, device="cpu")
    if args.rank == 0:
        maddr = next(m for m in board.visible_maddrs() if f"/ip4/{args.host}/" in m)
        tmp = args.maddr_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(maddr)
        os.replace(tmp, args.maddr_file)
    board.start()
    averaging = AveragingConfig(compression="none", target_group_size=2, allreduce_timeout_s=120.0)
    averager = SwarmAverager(
        board.dht,
        run_id="link",
        layout=layout_for([torch.Size([args.bytes // 4])], averaging),
        cfg=averaging,
        client_mode=False,
        state_provider=lambda: ({}, []),
    )
    try:
        x = [torch.ones(args.bytes // 4)]
        times = []
        for r in range(args.repeats + 1):  # round 0 warms up (connections, buffers)
            board.update(round=r, state=PeerState.AVERAGING)
            deadline = time.monotonic() + 60
            while True:  # both start together: the other is at this round too
                others = [p for p, rec in board.records().items() if p != board.peer_id and rec.round >= r]
                if others or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            averager.expect_group(sorted([board.peer_id, *others]), r)
            t0 = time.perf_counter()
            result = averager.average(x, weight=1.0, round=r)
            if r:
                times.append(time.perf_counter() - t0)
            assert result.group_size == 2, result
        board.update(round=args.repeats + 1, state=PeerState.DONE)
        time.sleep(2)  # the other's last all-reduce may still read from us
        return times
    finally:
        averager.shutdown()
        board.shutdown()


def _read(path: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no address in {path}")
        time.sleep(0.1)
    with open(path) as f:
        return f.read().strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["tcp", "gloo", "hivemind"])
    ap.add_argument("--rank", type=int, choices=[0, 1], required=True)
    ap.add_argument("--host", required=True, help="this side's address")
    ap.add_argument("--peer", required=True, help="the other side's address")
    ap.add_argument("--bytes", type=int, default=16_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--maddr-file", default="", help="hivemind: where rank 0 writes its multiaddr")
    ap.add_argument("--ifname", default="lo", help="gloo: the network interface of --host")
    args = ap.parse_args()
    torch.set_num_threads(1)
    times = {"tcp": tcp, "gloo": gloo, "hivemind": hivemind}[args.mode](args)
    print(
        json.dumps(
            {"mode": args.mode, "rank": args.rank, "seconds": times, "median_s": statistics.median(times)}
        )
    )
    os._exit(0)  # gloo's and hivemind's background threads can hold interpreter shutdown up


if __name__ == "__main__":
    main()
