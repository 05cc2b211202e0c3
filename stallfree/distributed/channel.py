"""Control messages between the engine and its workers, through torch.distributed's TCPStore.

The store is the rendezvous every torch.distributed job already has (MASTER_ADDR,
MASTER_PORT), so the same messages reach workers on this machine or on others.
Each message is a pickled object under its own key; readers poll for the key
(no blocking wait: an idle server would otherwise time out or log every second).
"""
from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

CHECK_EVERY_S = 0.5  # how often a waiting reader runs its liveness check


def put(store: dist.Store, key: str, obj: Any) -> None:
    store.set(key, pickle.dumps(obj))


def get(store: dist.Store, key: str, check: Callable[[], None] | None = None) -> Any:
    """Waits until `key` exists and returns its object. `check` runs every half
    second meanwhile and should raise if waiting is pointless (a peer died)."""
    start = time.monotonic()
    next_check = start + CHECK_EVERY_S
    while not store.check([key]):
        now = time.monotonic()
        if check is not None and now >= next_check:
            check()
            next_check = now + CHECK_EVERY_S
        # Short sleeps while busy (a reply is due within an iteration), up to 20 ms
        # when idle, so idle workers cost almost nothing.
        time.sleep(min(0.02, 0.0001 + (now - start) * 0.02))
    return pickle.loads(store.get(key))


def delete(store: dist.Store, *keys: str) -> None:
    for key in keys:
        store.delete_key(key)
