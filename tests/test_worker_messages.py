"""The control channel between engine and workers: typed, signed messages, no pickles.

A message forged into the store from outside (no secret, another secret, a real
message moved to another key, a pickle that would run code) is rejected before
anything of it is decoded, and a worker that meets one stops without executing it.
"""
from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys

import pytest
import torch.distributed as dist

from stallfree.distributed.channel import SECRET_ENV, Channel, ForgedMessage, new_secret
from stallfree.distributed.messages import (
    KvMessage,
    Message,
    RunMessage,
    WorkerConfig,
    WorkerInfo,
)

MARKER_ENV = "STALLFREE_TEST_MARKER"


class _Exploit:
    """Unpickling this creates the file named by $STALLFREE_TEST_MARKER."""

    def __reduce__(self):
        return (os.system, (f'touch "${MARKER_ENV}"',))


@pytest.fixture
def store():
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30),
                           master_listen_fd=sock.detach())
    yield master


def _outsider(store) -> dist.TCPStore:
    """Another client of the same store: anyone who can reach its port."""
    return dist.TCPStore("127.0.0.1", store.port, is_master=False,
                         timeout=datetime.timedelta(seconds=30))


def test_signed_messages_round_trip_and_forged_ones_are_rejected(store, tmp_path,
                                                                 monkeypatch):
    marker = tmp_path / "exploited"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    secret = new_secret()
    engine, worker = Channel(store, secret), Channel(_outsider(store), secret)
    engine.put("msg/0", KvMessage(12, 16))
    assert worker.get("msg/0", Message) == KvMessage(12, 16)

    attacker = _outsider(store)
    attacker.set("msg/1", pickle.dumps(_Exploit()))  # code, were it unpickled
    with pytest.raises(ForgedMessage, match="msg/1"):
        worker.read("msg/1", Message)
    Channel(attacker, new_secret()).put("msg/2", RunMessage([]))  # another run's secret
    with pytest.raises(ForgedMessage, match="signature"):
        worker.read("msg/2", Message)
    attacker.set("msg/3", attacker.get("msg/0"))  # a real message, replayed elsewhere
    with pytest.raises(ForgedMessage):
        worker.read("msg/3", Message)
    engine.put("ready/0", "not a WorkerInfo")  # signed, but not the type the key holds
    with pytest.raises(ForgedMessage, match="WorkerInfo"):
        worker.read("ready/0", WorkerInfo)
    assert not marker.exists()


def test_a_worker_stops_at_a_forged_message_and_runs_nothing(store, tiny_model, tmp_path):
    marker = tmp_path / "exploited"
    secret = new_secret()
    engine = Channel(store, secret)
    engine.put("config", WorkerConfig(tiny_model, "float32", "cpu", 1, 1, 0, 1))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", GLOO_SOCKET_IFNAME="lo",
               **{SECRET_ENV: secret.hex(), MARKER_ENV: str(marker)})
    worker = subprocess.Popen([sys.executable, "-m", "stallfree", "worker"], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert engine.get("ready/0", WorkerInfo).rank == 0  # loaded, waiting for msg/0
        _outsider(store).set("msg/0", pickle.dumps(_Exploit()))
        assert worker.wait(timeout=60) != 0
    finally:
        if worker.poll() is None:
            worker.kill()
    error = engine.read("error", str)
    assert "ForgedMessage" in error and "msg/0" in error, error
    assert not marker.exists()


def test_a_worker_without_the_secret_refuses_to_start(store):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALLFREE_WORKER")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, "-m", "stallfree", "worker"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and SECRET_ENV in done.stderr
