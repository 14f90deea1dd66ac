"""What p2ptrain adds to hivemind's children's pipes: whole messages, one sender at a time."""

import multiprocessing as mp
import threading

from p2ptrain.procs import SerialSends


def test_threads_sending_large_messages_at_once_do_not_interleave():
    # Over 16 KiB, multiprocessing sends a header and then a body: without SerialSends, three threads at once
    # corrupted the stream here within a few hundred messages (UnpicklingError at the reader).
    reader, writer = mp.Pipe(duplex=False)
    sends = SerialSends(writer)
    messages = {t: [bytes([t]) * (20_000 + i) for i in range(200)] for t in (1, 2, 3)}
    received: list[bytes] = []

    def read() -> None:
        for _ in range(sum(map(len, messages.values()))):
            received.append(reader.recv())

    threads = [threading.Thread(target=read)]
    threads += [threading.Thread(target=lambda t=t: [sends.send(m) for m in messages[t]]) for t in messages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert sorted(received) == sorted(m for ms in messages.values() for m in ms)
    assert sends.fileno() == writer.fileno()  # everything else is the connection's own
