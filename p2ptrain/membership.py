"""Who takes part in a run: holders of its swarm key, each under one identity.

**The swarm key** (``swarm.key_file``, made by ``p2ptrain keygen``) is a 256-bit secret that every peer,
bootstrap node and status reader of a swarm shares. Every DHT request and response carries an HMAC of its
bytes under the key, with a time and a nonce (:class:`SwarmKeyAuthorizer`, plugged into hivemind's
``DHT(authorizer=...)``). A node without the key can neither read nor write the run's records, and it
cannot join the DHT: nobody answers it, and it answers nobody. The averager's RPCs (join a group, send a
part, download the state), which hivemind does not authorize, admit only peers that have a live progress
record of the run (``averaging.py``), which only key holders can write. Without a key the swarm is open:
anyone who can reach a peer can do all of that, and every peer says so at start.

**An identity** is a libp2p RSA key. The same key signs the peer's progress record, so a record's
``peer_id`` is checked against its signer (:func:`peer_id_of_owner`): a peer cannot publish records in
another's name, and it has one record per identity.

What a key holder can still do (send bad pseudo-gradients, lie about its samples) is the business of
the checks in ``averaging.py``, ``diloco.py`` and ``transfer.py``; docs/architecture.md has the threat model.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import os
import re
import secrets
import tempfile
import threading
import time
from pathlib import Path

import base58
import multihash
from cryptography.hazmat.primitives import serialization
from hivemind.proto import crypto_pb2
from hivemind.utils.auth import AuthorizedRequestBase, AuthorizedResponseBase, AuthorizerBase
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import TimedStorage, get_dht_time

from p2ptrain.addrs import SwarmError
from p2ptrain.config import read_key_file
from p2ptrain.logs import get_logger

log = get_logger(__name__)

KEY_BYTES = 32
_MAX_CLOCK_SKEW_S = 300.0
"""A request signed further from our clock than this is refused (a replay, or a clock that is far off)."""
_REQUEST, _RESPONSE = b"p2ptrain/dht-request/v1\0", b"p2ptrain/dht-response/v1\0"


MAX_TUPLE_DEPTH = 32
"""The deepest nesting of tuples that a msgpack message from another peer may hold (ours hold a few)."""
_tuple_depth = threading.local()
_decode_ext_types = MSGPackSerializer._decode_ext_types.__func__  # type: ignore[attr-defined]


def _decode_ext_types_bounded(cls: type, type_code: int, data: bytes) -> object:
    """hivemind's ``MSGPackSerializer`` decodes a tuple by calling msgpack again on its bytes, once per level,
    on the C stack: 300 nested tuples (1.4 kB that anyone who can reach a peer may send, in a DHT store, a
    push, a join request or a state's metadata) crashed the process with SIGSEGV, which nothing catches.
    Deeper than :data:`MAX_TUPLE_DEPTH` is a ValueError, which the callers refuse like any malformed message."""
    depth = getattr(_tuple_depth, "depth", 0)
    if depth >= MAX_TUPLE_DEPTH:
        raise ValueError(f"a msgpack message nests tuples more than {MAX_TUPLE_DEPTH} deep")
    _tuple_depth.depth = depth + 1
    try:
        return _decode_ext_types(cls, type_code, data)
    finally:
        _tuple_depth.depth = depth


# Every msgpack message this process and the processes it forks (the DHT, the averager) decode: imported by
# the records board and the averager alike.
MSGPackSerializer._decode_ext_types = classmethod(_decode_ext_types_bounded)  # type: ignore[method-assign,assignment]


def generate_swarm_key(path: Path) -> None:
    """Write a new swarm key to ``path`` (readable by its owner only); refuse to overwrite one."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise SwarmError(f"{path} already exists; a swarm key is never overwritten") from None
    except OSError as e:
        raise SwarmError(f"cannot write {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(KEY_BYTES) + "\n")


def read_swarm_key(path: Path) -> bytes:
    """The key in ``path``, or :class:`SwarmError` naming ``swarm.key_file`` and what is wrong."""
    try:
        key = read_key_file(path)
    except ValueError as e:
        raise SwarmError(str(e)) from None
    if path.stat().st_mode & 0o077:
        log.warning("the swarm key file is readable by other users of this machine", path=str(path))
    return key


class Throttle:
    """Counts an event and lets a warning about it through at most once per ``period_s``."""

    def __init__(self, period_s: float = 60.0):
        self.period_s, self._last, self._count = period_s, -float("inf"), 0
        self._lock = threading.Lock()

    def due(self) -> int:
        """How many times it happened since the last warning, when one is due now; else 0."""
        with self._lock:
            self._count += 1
            now = time.monotonic()
            if now - self._last < self.period_s:
                return 0
            count, self._count, self._last = self._count, 0, now
            return count


class SwarmKeyAuthorizer(AuthorizerBase):
    """hivemind's DHT authorizer for a swarm key: every request and response carries an HMAC-SHA256 of its
    bytes under the key. Requests also carry a time and a nonce, so that a recorded one cannot be played
    again; a response carries its request's nonce, so that it answers that request only."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"a swarm key has {KEY_BYTES} bytes, not {len(key)}")
        self._key = key
        self._recent_nonces: TimedStorage = TimedStorage()
        self._refused_requests, self._refused_responses = Throttle(), Throttle()

    def _mac(self, purpose: bytes, message) -> bytes:
        # The message's type is in the MAC: a signed ping cannot pass for a store with the same bytes.
        kind = type(message).DESCRIPTOR.full_name.encode()
        return hmac.new(
            self._key, purpose + kind + b"\0" + message.SerializeToString(), hashlib.sha256
        ).digest()

    def _signed(self, purpose: bytes, message) -> bool:
        """Whether the message's signature is our HMAC of it (computed with the signature field empty)."""
        signature = message.auth.signature
        message.auth.signature = b""
        try:
            return hmac.compare_digest(signature, self._mac(purpose, message))
        finally:
            message.auth.signature = signature

    async def sign_request(self, request: AuthorizedRequestBase, service_public_key) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(16)
        auth.signature = b""
        auth.signature = self._mac(_REQUEST, request)

    async def validate_request(self, request: AuthorizedRequestBase) -> bool:
        auth = request.auth
        now = get_dht_time()
        reason = None
        if not self._signed(_REQUEST, request):
            reason = "it does not carry this swarm's key"
        elif abs(auth.time - now) > _MAX_CLOCK_SKEW_S:
            reason = f"its time is {auth.time - now:+.0f}s from ours (replayed, or a clock far off)"
        else:
            with self._recent_nonces.freeze():
                if auth.nonce in self._recent_nonces:
                    reason = "it was sent before (replayed)"
        if reason is not None:
            if count := self._refused_requests.due():
                log.warning("refused DHT requests", reason=reason, count=count, hint=_HINT)
            return False
        self._recent_nonces.store(auth.nonce, None, now + 3 * _MAX_CLOCK_SKEW_S)
        return True

    async def sign_response(self, response: AuthorizedResponseBase, request: AuthorizedRequestBase) -> None:
        auth = response.auth
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self._mac(_RESPONSE, response)

    async def validate_response(
        self, response: AuthorizedResponseBase, request: AuthorizedRequestBase
    ) -> bool:
        auth = response.auth
        if self._signed(_RESPONSE, response) and auth.nonce == request.auth.nonce:
            return True
        if count := self._refused_responses.due():
            log.warning(
                "refused DHT answers: the peer does not hold this swarm's key", count=count, hint=_HINT
            )
        return False


_HINT = "every peer, bootstrap node and status reader of a swarm needs the same swarm.key_file"


def load_identity(path: Path) -> RSAPrivateKey:
    """The RSA key of a libp2p identity file (as hivemind writes it), to sign records with."""
    key = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    if key.key_type != crypto_pb2.KeyType.RSA:
        raise SwarmError(f"swarm.identity_path {path}: not an RSA identity (hivemind makes RSA ones)")
    private = RSAPrivateKey.__new__(RSAPrivateKey)
    private.__setstate__({"_private_key": key.data})
    return private


def create_identity(path: Path) -> RSAPrivateKey:
    """Write a new libp2p identity to ``path`` and return its key; if another process made one there first,
    return that one.

    Not with hivemind's ``P2P.generate_identity``: it writes the file in place, so a peer killed mid-write
    leaves a truncated key that every later start refuses, and the private key is readable by everyone until
    its chmod. Here the key is written whole to a temporary file only we can read, then linked into place,
    which never replaces a file that is there.
    """
    key = RSAPrivateKey()
    data = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o400)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return load_identity(path)
        except OSError:  # a file system without hard links: a rename is atomic too, if last-come-wins
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return key


def peer_id_of(public_key: RSAPublicKey) -> str:
    """The libp2p peer id (base58) of an RSA public key, as libp2p derives it."""
    der = public_key._public_key.public_bytes(
        encoding=serialization.Encoding.DER, format=serialization.PublicFormat.SubjectPublicKeyInfo
    )
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    digest = multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256"))
    return base58.b58encode(digest).decode()


_OWNER_RE = re.compile(rb"^\[owner:(.+)\]$", re.DOTALL)


@functools.lru_cache(maxsize=4096)  # every reading of the records parses every subkey's key: once is enough
def peer_id_of_owner(subkey: object) -> str | None:
    """The peer id of the key that signed a protected DHT record (its ``[owner:...]`` subkey); None if the
    subkey is not one."""
    if not isinstance(subkey, bytes):
        return None
    match = _OWNER_RE.match(subkey)
    if match is None:
        return None
    try:
        return peer_id_of(RSAPublicKey.from_bytes(match.group(1)))
    except Exception:  # not an RSA key in OpenSSH form: not a record any peer of ours signed
        return None
