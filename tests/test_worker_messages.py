"""The control channel between engine and workers: typed, encrypted, signed messages,
no pickles.

A message forged into the store from outside (no secret, another secret, a real
message moved to another key, a pickle that would run code) is rejected before
anything of it is decoded; a worker that meets one ignores it and runs the engine's
genuine message once it overwrites it, and a forged stop stops nothing. What the
store holds reveals no prompt, and a message that cannot be encoded writes nothing.
"""
from __future__ import annotations

import datetime
import os
import pickle
import subprocess
import sys

import msgspec
import pytest
import torch.distributed as dist

from stallfree.distributed.channel import (
    SECRET_ENV,
    Channel,
    ForgedMessage,
    MalformedMessage,
    new_secret,
)
from stallfree.distributed.messages import (
    STOP_KEY,
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
    with pytest.raises(ForgedMessage, match="this run.s secret"):
        worker.read("msg/2", Message)
    attacker.set("msg/3", attacker.get("msg/0"))  # a real message, replayed elsewhere
    with pytest.raises(ForgedMessage):
        worker.read("msg/3", Message)
    engine.put("ready/0", "not a WorkerInfo")  # signed, but not the type the key holds
    with pytest.raises(MalformedMessage, match="WorkerInfo"):
        worker.read("ready/0", WorkerInfo)
    # Waiting readers skip what is forged, as if the key were empty, until the genuine
    # message overwrites it.
    assert worker.read_genuine("msg/1", Message) is None
    engine.put("msg/1", KvMessage(3, 16))
    assert worker.get("msg/1", Message) == KvMessage(3, 16)
    assert not marker.exists()


def test_the_store_reveals_no_prompt(store):
    """Anyone who can reach the store's port reads only ciphertext there."""
    from stallfree.distributed.messages import WireChunk

    prompt = list(range(40_000, 40_064))
    channel = Channel(store, new_secret())
    channel.put("msg/0", RunMessage([WireChunk("secret-request", 0, 64, [0], prompt, False)]))
    raw = _outsider(store).get("msg/0")
    plain = msgspec.msgpack.encode(prompt)
    assert plain not in raw and b"secret-request" not in raw
    assert not any(plain[i:i + 9] in raw for i in range(len(plain) - 9))
    assert channel.read("msg/0", Message).chunks[0].token_ids == prompt


def test_a_batch_that_cannot_be_encoded_writes_nothing_and_keeps_the_index(store):
    """Else the workers would wait forever for the index skipped, and every batch after
    it would go unread."""
    from stallfree.distributed.distributed_executor import DistributedExecutor

    executor = DistributedExecutor.__new__(DistributedExecutor)  # no workers needed
    executor.channel, executor._next = Channel(store, new_secret()), 5
    with pytest.raises(OverflowError):
        executor._send(2**64)
    assert executor._next == 5 and not executor.channel.has("msg/5")
    assert executor._send(KvMessage(1, 16)) == 5 and executor.channel.has("msg/5")


def _start_worker(store, engine: Channel, secret: bytes, model: str,
                  **env: str) -> subprocess.Popen:
    """A real rank 0 of 1 on `store`, its stderr piped; the engine's config is posted."""
    engine.put("config", WorkerConfig(model, "float32", "cpu", 1, 1, 0, 1))
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", GLOO_SOCKET_IFNAME="lo",
               **{SECRET_ENV: secret.hex()}, **env)
    return subprocess.Popen([sys.executable, "-m", "stallfree", "worker"], env=env,
                            stderr=subprocess.PIPE, text=True)


def test_a_worker_ignores_a_forged_message_and_runs_the_engines(store, tiny_model, tmp_path):
    marker = tmp_path / "exploited"
    secret = new_secret()
    engine = Channel(store, secret)
    worker = _start_worker(store, engine, secret, tiny_model, **{MARKER_ENV: str(marker)})
    try:
        assert engine.get("ready/0", WorkerInfo).rank == 0  # loaded, waiting for msg/0
        _outsider(store).set("msg/0", pickle.dumps(_Exploit()))
        _outsider(store).set("error", b"forged")  # the engine must not take it either
        assert engine.read_genuine("error", str) is None
        _ignored(worker, "msg/0")  # it has met the forged message and waits on

        def alive() -> None:
            assert worker.poll() is None, "a forged message stopped the worker"
        engine.put("msg/0", KvMessage(4, 16))  # the engine's own overwrites the forged one
        assert engine.get("ack/0/0", bool, alive)
        engine.put(STOP_KEY, True)
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    assert not marker.exists()


def test_only_the_engines_signed_stop_stops_a_worker(store, tiny_model):
    secret = new_secret()
    engine = Channel(store, secret)
    worker = _start_worker(store, engine, secret, tiny_model)
    try:
        assert engine.get("ready/0", WorkerInfo).rank == 0  # loaded, waiting for msg/0
        _outsider(store).set(STOP_KEY, b"1")  # one bare set, from anyone on the port
        _ignored(worker, STOP_KEY)  # idle ranks look for a stop every CHECK_EVERY_S

        def alive() -> None:
            assert worker.poll() is None, "a forged stop stopped the worker"
        engine.put("msg/0", KvMessage(4, 16))
        assert engine.get("ack/0/0", bool, alive)  # it still serves
        engine.put(STOP_KEY, True)  # the engine's own, signed: overwrites the forged one
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()


def _ignored(worker: subprocess.Popen, key: str) -> None:
    """Returns once `worker` has said it ignored a forged message under `key` (once)."""
    said = f"rank 0: ignored a message not from this run's engine or workers: " \
           f"rejected the message under {key!r}"
    for line in worker.stderr:
        if said in line:
            return
    raise AssertionError(f"the worker exited without ignoring {key!r}")


def test_a_worker_without_the_secret_refuses_to_start(store):
    env = {k: v for k, v in os.environ.items() if not k.startswith("STALLFREE_WORKER")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RANK="0", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, "-m", "stallfree", "worker"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and SECRET_ENV in done.stderr


def test_a_batch_carries_what_a_rank_samples_with(store):
    import torch

    from stallfree import SamplingParams
    from stallfree.distributed.messages import run_message, worker_batch
    from stallfree.request import Request
    from stallfree.scheduler.output import ScheduledChunk, SchedulerOutput

    params = SamplingParams(temperature=0.5, top_k=7, min_p=0.1, seed=3, min_tokens=2,
                            stop_token_ids=[9], repetition_penalty=1.2, logprobs=2)
    penalised = Request("p", [1, 2, 3], params, 0.0, frozenset({2}))
    penalised.output_token_ids = [4, 5]
    plain = Request("q", [6, 7, 8, 9], SamplingParams(temperature=0.0), 0.0, frozenset({2}))
    plain.output_token_ids = [10]
    plain.num_computed_tokens = 4
    output = SchedulerOutput([ScheduledChunk(penalised, 0, 5, [0]),
                              ScheduledChunk(plain, 4, 1, [1])])
    output.token_bitmask = torch.tensor([[-1, 5]], dtype=torch.int32)  # structured outputs
    output.bitmask_rows = {"p": 0}
    channel = Channel(store, new_secret())
    channel.put("msg/0", run_message(output))
    batch = worker_batch(channel.read("msg/0", Message))
    first, decode = batch.chunks
    assert first.token_ids == [1, 2, 3, 4, 5] and first.request.all_token_ids == [1, 2, 3, 4, 5]
    sent = first.request.sampling_params
    for name in ("temperature", "top_k", "min_p", "seed", "min_tokens", "stop_token_ids",
                 "repetition_penalty", "logprobs"):
        assert getattr(sent, name) == getattr(params, name), name
    assert first.request.num_output_tokens == 2 and first.request.eos_token_ids == {2}
    # A decode without penalties sends its one token, not its history.
    assert decode.token_ids == [10] and decode.request.all_token_ids == []
    assert decode.request.num_output_tokens == 1 and decode.block_table == [1]
    assert batch.token_bitmask.tolist() == [[-1, 5]] and batch.bitmask_rows == {"p": 0}


def test_a_replayed_heartbeat_is_no_beat(store):
    """An old signed heartbeat, copied back by anyone on the port, must not keep a rank
    that stopped beating looking alive."""
    from stallfree.distributed.distributed_executor import DistributedExecutor

    executor = DistributedExecutor.__new__(DistributedExecutor)  # no workers needed
    executor.channel, executor.world_size, executor._heartbeats = \
        Channel(store, new_secret()), 1, {}
    executor.channel.put("hb/0", 3)
    old = store.get("hb/0")
    executor.channel.put("hb/0", 4)
    assert executor._silent_rank() is None
    seen = executor._heartbeats[0]
    _outsider(store).set("hb/0", old)  # genuine, but older: a replay
    assert executor._silent_rank() is None and executor._heartbeats[0] == seen
