"""Control messages between the engine and its workers, through torch.distributed's TCPStore.

The store is the rendezvous every torch.distributed job already has (MASTER_ADDR,
MASTER_PORT), so the same messages reach workers on this machine or on others.
Each message is msgpack of an explicit type (`messages.py`), never a pickle,
sealed with AES-256-GCM under a key derived from a per-run secret, its store key
authenticated with it: anyone who can reach the store's port but lacks the secret can
read no prompt from it, and can neither forge a message nor replay one under another
key. The store is no
control surface: a value that fails its check is never decoded, and a reader waiting
for a key skips it (logged once) until the genuine message overwrites it, so a
forged key stops, fails or feeds nothing. A message that cannot be encoded raises
before anything is written. Readers poll for the key (no blocking wait: an idle
server would otherwise time out or log every second).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..env import WORKER_SECRET, WORKER_SECRET_FILE, worker_secret_text

T = TypeVar("T")
logger = logging.getLogger("stallfree.distributed")

CHECK_EVERY_S = 0.5  # how often a waiting reader runs its liveness check
SECRET_ENV, SECRET_FILE_ENV = WORKER_SECRET, WORKER_SECRET_FILE  # hex; or a file holding it
_NONCE_BYTES = 12  # AES-GCM's; random per message (2**-32 collision odds at 2**32 messages)
_TAG_BYTES = 16  # AES-GCM's authentication tag, at the end of the ciphertext


class ForgedMessage(RuntimeError):
    """A message that fails authentication: not from this run's engine or workers."""


class MalformedMessage(RuntimeError):
    """A signed message that is not the type its key holds: engine and workers of
    different versions (never skipped: waiting would not fix it)."""


def secret_from_env(env: dict[str, str] | None = None) -> bytes | None:
    """The run's secret from $STALLFREE_WORKER_SECRET (hex) or the file named by
    $STALLFREE_WORKER_SECRET_FILE; None if neither is set."""
    text = worker_secret_text(env)
    if not text:
        return None
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{SECRET_ENV} must be hex (e.g. `openssl rand -hex 32`)") from None
    if len(secret) < 16:
        raise ValueError(f"{SECRET_ENV} must hold at least 16 bytes (32 hex digits)")
    return secret


def new_secret() -> bytes:
    return secrets.token_bytes(32)


class Channel:
    """Encrypted, signed, typed messages under string keys of a store."""

    def __init__(self, store: dist.Store, secret: bytes) -> None:
        self.store = store
        # The cipher's key is derived from the secret, not the secret itself.
        self._aead = AESGCM(hmac.new(secret, b"stallfree/aead", hashlib.sha256).digest())
        self._encoder = msgspec.msgpack.Encoder()
        self._forged: dict[str, bytes] = {}  # key -> the forged value last reported there

    def put(self, key: str, obj: Any) -> None:
        """Writes `obj` under `key`; raises (having written nothing) if it cannot be encoded."""
        payload = self._encoder.encode(obj)
        nonce = secrets.token_bytes(_NONCE_BYTES)
        # The store key is authenticated data: a message cannot be moved to another key.
        self.store.set(key, nonce + self._aead.encrypt(nonce, payload, key.encode()))

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def read(self, key: str, type_: type[T]) -> T:
        """The message under `key` (which must exist), checked and decoded as `type_`;
        raises ForgedMessage if it is not this run's."""
        return self._open(key, self.store.get(key), type_)

    def read_genuine(self, key: str, type_: type[T]) -> T | None:
        """The message under `key` if there is one from this run, else None: a forged
        value is ignored (and logged once), as if the key were not there."""
        if not self.store.check([key]):
            return None
        raw = self.store.get(key)
        try:
            return self._open(key, raw, type_)
        except ForgedMessage as exc:
            if self._forged.get(key) != raw[-_TAG_BYTES:]:  # once per value, not every poll
                self._forged[key] = raw[-_TAG_BYTES:]
                logger.warning("ignored a message not from this run's engine or workers: %s",
                               exc)
            return None

    def _open(self, key: str, raw: bytes, type_: type[T]) -> T:
        try:
            if len(raw) < _NONCE_BYTES + _TAG_BYTES:
                raise InvalidTag
            payload = self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], key.encode())
        except InvalidTag:
            raise ForgedMessage(f"rejected the message under {key!r}: it was not sealed with "
                                f"this run's secret (is something else writing to the "
                                f"store's port?)") from None
        self._forged.pop(key, None)
        try:
            return msgspec.msgpack.decode(payload, type=type_)
        except msgspec.DecodeError as exc:  # signed but malformed: a version mismatch
            raise MalformedMessage(f"the message under {key!r} is not a {type_}: {exc}") from exc

    def get(self, key: str, type_: type[T], check: Callable[[], None] | None = None) -> T:
        """Waits until `key` holds a genuine message and returns it. `check` runs every
        half second meanwhile and should raise if waiting is pointless (a peer died)."""
        start = time.monotonic()
        next_check = start + CHECK_EVERY_S
        while (message := self.read_genuine(key, type_)) is None:
            now = time.monotonic()
            if check is not None and now >= next_check:
                check()
                next_check = now + CHECK_EVERY_S
            # Short sleeps while busy (a reply is due within an iteration), up to 20 ms
            # when idle, so idle workers cost almost nothing.
            time.sleep(min(0.02, 0.0001 + (now - start) * 0.02))
        return message

    def delete(self, *keys: str) -> None:
        for key in keys:
            self.store.delete_key(key)
            self._forged.pop(key, None)
