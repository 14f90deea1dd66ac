"""Multiaddrs: parsing users' addresses, and the files a bootstrap node writes them to.

Kept apart from ``swarm.py`` so that the config can validate addresses without importing the DHT.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hivemind.utils.multiaddr import Multiaddr


class SwarmError(RuntimeError):
    """The swarm cannot be joined or used (unreachable peers, daemon failure). The message is for users."""


def parse_multiaddr(value: str) -> Multiaddr:
    """Parse a multiaddr, raising ``ValueError`` with a one-line reason on bad input."""
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError(f"not a multiaddr (expected e.g. /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo...): {value!r}")
    # Imported here: importing hivemind takes two seconds (and torch with it), which `p2ptrain config
    # validate` and every other command that never touches the swarm should not pay.
    from hivemind.utils.multiaddr import Multiaddr

    try:
        return Multiaddr(value)
    except Exception as e:  # the vendored parser raises a zoo of types (ValueError, KeyError, binascii.Error)
        raise ValueError(f"not a valid multiaddr: {value!r} ({e})") from None


def check_peer_maddr(value: str) -> None:
    """Raise ``ValueError`` unless ``value`` names a peer (``/p2p/<peer id>``): libp2p dials a peer, not an
    address, and without its id refuses the address only once the daemon is up."""
    if "/p2p/" not in value and "/ipfs/" not in value:  # /ipfs/ is libp2p's older name for /p2p/
        raise ValueError(
            f"{value!r} has no /p2p/<peer id> part: give the whole address a peer prints, e.g. "
            "/ip4/203.0.113.5/tcp/31337/p2p/12D3Koo..."
        )


def is_loopback(maddr: str) -> bool:
    return maddr.startswith(("/ip4/127.", "/ip6/::1/", "/dns/localhost/", "/dns4/localhost/"))


MADDRS_FILE_MAX_BYTES = 1 << 20


def read_at_most(path: Path, limit: int) -> bytes | None:
    """The bytes of ``path``, or None if it holds more than ``limit`` (never all of a device such as
    /dev/zero, or of a huge file). Raises what ``open`` and ``read`` raise."""
    with open(path, "rb") as f:
        raw = f.read(limit + 1)
    return raw if len(raw) <= limit else None


def read_maddrs_file(path: Path | None, timeout_s: float) -> list[str]:
    """Multiaddrs from a file written by ``p2ptrain dht --maddrs-file``, waiting for it to appear."""
    if path is None:
        return []
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            raw = read_at_most(Path(path), MADDRS_FILE_MAX_BYTES)
            if raw is None:
                raise SwarmError(
                    f"swarm.initial_peers_file {path}: over {MADDRS_FILE_MAX_BYTES} bytes: not a list of "
                    "multiaddrs (`p2ptrain dht --maddrs-file` writes one)"
                )
            lines = [line.strip() for line in raw.decode().splitlines()]
        except FileNotFoundError:
            lines = []
        except (OSError, UnicodeDecodeError) as e:  # a folder, unreadable, not text: it will not get better
            reason = getattr(e, "strerror", None) or f"not UTF-8 text (byte {getattr(e, 'start', '?')})"
            raise SwarmError(f"swarm.initial_peers_file {path}: cannot read it ({reason})") from None
        maddrs = [line for line in lines if line and not line.startswith("#")]
        if maddrs:
            for maddr in maddrs:
                try:
                    parse_multiaddr(maddr)
                    check_peer_maddr(maddr)
                except ValueError as e:
                    raise SwarmError(f"swarm.initial_peers_file {path}: {e}") from None
            return maddrs
        if time.monotonic() > deadline:
            raise SwarmError(
                f"swarm.initial_peers_file {path}: no multiaddr appeared within {timeout_s:.0f}s"
            )
        time.sleep(0.5)


def check_writable(path: Path) -> None:
    """Raise ``OSError`` now if ``path`` cannot be written later (its folder is missing and cannot be made,
    or is not writable, or the path is a folder)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(21, "is a directory")
    for folder in (path.parent, *path.parent.parents):
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(20, f"{folder} is not a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    probe = path.with_name(path.name + ".probe")
    probe.write_text("")
    probe.unlink()


def write_maddrs_file(path: Path, maddrs: Sequence[str]) -> None:
    """Atomically, so that a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{m}\n" for m in maddrs))
    os.replace(tmp, path)
