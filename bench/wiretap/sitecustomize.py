"""A bench-only tap on what a peer's processes say to their ``p2pd``, by libp2p protocol: put this folder on a
peer's ``PYTHONPATH`` and set ``P2PTRAIN_WIRETAP`` to a folder, and every process of the peer (the trainer,
the DHT child, the averager child: forks are followed) appends its counters there every 0.25 s, one file per
process (``<pid>.jsonl``: wall time and, by protocol, bytes out, bytes in, calls or streams).

What it counts is the bytes of unary calls and streams as hivemind hands them to ``p2pd`` and takes them
back; libp2p's own framing, encryption and background protocols (identify, ping) are not in it: what
``p2pd``'s own byte counts show beyond it (``bench.utilization``) is theirs.
"""

from __future__ import annotations

import os

if os.environ.get("P2PTRAIN_WIRETAP"):
    import json
    import threading
    import time
    from collections import defaultdict
    from pathlib import Path

    from hivemind.p2p.p2p_daemon_bindings import control

    _folder = Path(os.environ["P2PTRAIN_WIRETAP"])
    _folder.mkdir(parents=True, exist_ok=True)
    _counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # protocol -> [out, in, calls]
    _lock = threading.Lock()

    def _add(proto: str, out: int = 0, into: int = 0, calls: int = 0) -> None:
        with _lock:
            c = _counts[proto]
            c[0] += out
            c[1] += into
            c[2] += calls

    def _dump_loop() -> None:
        path, last = _folder / f"{os.getpid()}.jsonl", None
        while True:
            time.sleep(0.25)
            with _lock:
                snapshot = {k: list(v) for k, v in _counts.items()}
            if snapshot != last:
                with open(path, "a") as f:
                    f.write(json.dumps({"t": time.time(), "c": snapshot}) + "\n")
                last = snapshot

    def _start() -> None:
        threading.Thread(target=_dump_loop, daemon=True).start()

    def _after_fork() -> None:
        global _lock
        _lock = threading.Lock()
        _counts.clear()
        _start()

    os.register_at_fork(after_in_child=_after_fork)
    _start()

    class _Reader:
        def __init__(self, inner, proto):
            self._inner, self._proto = inner, proto

        def __getattr__(self, name):
            return getattr(self._inner, name)

        async def readexactly(self, n):
            data = await self._inner.readexactly(n)
            _add(self._proto, into=len(data))
            return data

        async def read(self, n=-1):
            data = await self._inner.read(n)
            _add(self._proto, into=len(data))
            return data

    class _Writer:
        def __init__(self, inner, proto):
            self._inner, self._proto = inner, proto

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def write(self, data):
            _add(self._proto, out=len(data))
            return self._inner.write(data)

        def writelines(self, lines):
            for line in lines:
                self.write(line)

    def _tag(proto: str, data: bytes) -> str:
        """A DHT call's protocol with the key it is about (the first 8 hex digits of its DHTID)."""
        if proto.startswith("DHTProtocol.rpc_store") or proto.startswith("DHTProtocol.rpc_find"):
            from hivemind.proto import dht_pb2

            kind = dht_pb2.StoreRequest if "rpc_store" in proto else dht_pb2.FindRequest
            try:
                keys = kind.FromString(data).keys
            except Exception:
                return proto
            if keys:
                return f"{proto} {keys[0].hex()[:8]}{'+' if len(keys) > 1 else ''}"
        return proto

    _call = control.ControlClient.call_unary_handler

    async def call_unary_handler(self, peer_id, proto, data):
        response = await _call(self, peer_id, proto, data)
        _add(_tag(proto, data), out=len(data), into=len(response), calls=1)
        return response

    _add_unary = control.ControlClient.add_unary_handler

    async def add_unary_handler(self, proto, handler, balanced=False):
        async def counted(data, remote):
            response = await handler(data, remote)
            _add(_tag(proto, data) + " (served)", into=len(data), out=len(response), calls=1)
            return response

        return await _add_unary(self, proto, counted, balanced)

    _open = control.ControlClient.stream_open

    async def stream_open(self, peer_id, protocols):
        info, reader, writer = await _open(self, peer_id, protocols)
        proto = info.proto or ",".join(protocols)
        _add(proto, calls=1)
        return info, _Reader(reader, proto), _Writer(writer, proto)

    _handle = control.ControlClient.stream_handler

    async def stream_handler(self, proto, handler_cb, balanced=False):
        async def counted(info, reader, writer):
            name = proto + " (served)"
            _add(name, calls=1)
            return await handler_cb(info, _Reader(reader, name), _Writer(writer, name))

        return await _handle(self, proto, counted, balanced)

    control.ControlClient.call_unary_handler = call_unary_handler
    control.ControlClient.add_unary_handler = add_unary_handler
    control.ControlClient.stream_open = stream_open
    control.ControlClient.stream_handler = stream_handler
