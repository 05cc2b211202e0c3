"""Control messages between the engine and its workers, through torch.distributed's TCPStore.

The store is the rendezvous every torch.distributed job already has (MASTER_ADDR,
MASTER_PORT), so the same messages reach workers on this machine or on others.
Each message is msgpack of an explicit type (`messages.py`), never a pickle, signed
with HMAC-SHA256 under a per-run secret: anyone who can reach the store's port but
lacks the secret can neither forge nor replay a message under another key, and a
message that fails its check raises `ForgedMessage` before anything is decoded.
Readers poll for the key (no blocking wait: an idle server would otherwise time
out or log every second).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import torch.distributed as dist

T = TypeVar("T")

CHECK_EVERY_S = 0.5  # how often a waiting reader runs its liveness check
SECRET_ENV = "STALLFREE_WORKER_SECRET"  # hex; or a file holding it:
SECRET_FILE_ENV = "STALLFREE_WORKER_SECRET_FILE"
_MAC_BYTES = 32


class ForgedMessage(RuntimeError):
    """A message whose signature does not match: not from this run's engine or workers."""


def secret_from_env(env: dict[str, str] | None = None) -> bytes | None:
    """The run's secret from $STALLFREE_WORKER_SECRET (hex) or the file named by
    $STALLFREE_WORKER_SECRET_FILE; None if neither is set."""
    env = os.environ if env is None else env
    text = env.get(SECRET_ENV)
    if not text and env.get(SECRET_FILE_ENV):
        with open(env[SECRET_FILE_ENV]) as f:
            text = f.read()
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
    """Signed, typed messages under string keys of a store."""

    def __init__(self, store: dist.Store, secret: bytes) -> None:
        self.store = store
        self._secret = secret
        self._encoder = msgspec.msgpack.Encoder()

    def _mac(self, key: str, payload: bytes) -> bytes:
        # The key is signed with the payload: a message cannot be moved to another key.
        return hmac.new(self._secret, key.encode() + b"\0" + payload, hashlib.sha256).digest()

    def put(self, key: str, obj: Any) -> None:
        payload = self._encoder.encode(obj)
        self.store.set(key, self._mac(key, payload) + payload)

    def has(self, key: str) -> bool:
        return self.store.check([key])

    def read(self, key: str, type_: type[T]) -> T:
        """The message under `key` (which must exist), checked and decoded as `type_`."""
        raw = self.store.get(key)
        mac, payload = raw[:_MAC_BYTES], raw[_MAC_BYTES:]
        if len(raw) < _MAC_BYTES or not hmac.compare_digest(mac, self._mac(key, payload)):
            raise ForgedMessage(f"rejected the message under {key!r}: its signature does not "
                                f"match this run's secret (is something else writing to the "
                                f"store's port?)")
        try:
            return msgspec.msgpack.decode(payload, type=type_)
        except msgspec.DecodeError as exc:  # signed but malformed: a version mismatch
            raise ForgedMessage(f"the message under {key!r} is not a {type_}: {exc}") from exc

    def get(self, key: str, type_: type[T], check: Callable[[], None] | None = None) -> T:
        """Waits until `key` exists and returns its message. `check` runs every half
        second meanwhile and should raise if waiting is pointless (a peer died)."""
        start = time.monotonic()
        next_check = start + CHECK_EVERY_S
        while not self.store.check([key]):
            now = time.monotonic()
            if check is not None and now >= next_check:
                check()
                next_check = now + CHECK_EVERY_S
            # Short sleeps while busy (a reply is due within an iteration), up to 20 ms
            # when idle, so idle workers cost almost nothing.
            time.sleep(min(0.02, 0.0001 + (now - start) * 0.02))
        return self.read(key, type_)

    def delete(self, *keys: str) -> None:
        for key in keys:
            self.store.delete_key(key)
