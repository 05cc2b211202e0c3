"""SarathiScheduler driven by a fake executor: unit cases and random workloads."""
from __future__ import annotations

import ast
import importlib.util
import pathlib
import sys

import pytest

from scheduler_helpers import TOKEN, make_request, new_scheduler, run_until_done, shape, step
from stallfree.config import SchedulerConfig
from stallfree.request import RequestStatus
from stallfree.scheduler import BlockManager, SarathiScheduler, make_scheduler
from stallfree.scheduler.batch import Batch
from stallfree.scheduler.output import ScheduledChunk


def make_scheduler_for_test(**kwargs) -> SarathiScheduler:
    sched = new_scheduler("sarathi", **kwargs)
    assert isinstance(sched, SarathiScheduler)
    return sched


# ---- stall-free batching -----------------------------------------------------
def test_decodes_first_then_partial_prefill_then_new_requests():
    sched = make_scheduler_for_test(budget=10)
    for rid, n in (("A", 4), ("B", 20), ("C", 3)):
        sched.add_request(make_request(rid, n))
    out, _ = step(sched)
    assert shape(out) == [("A", 0, 4), ("B", 0, 6)]  # C waits: budget spent
    assert [c.samples for c in out.chunks] == [True, False]
    out, _ = step(sched)
    assert shape(out) == [("A", 4, 1), ("B", 6, 9)]  # the decode first, then the chunk
    assert (out.num_decode_tokens, out.num_prefill_tokens, out.num_batched_tokens) == (1, 9, 10)
    out, _ = step(sched)
    assert shape(out) == [("A", 5, 1), ("B", 15, 5), ("C", 0, 3)]  # B completes, C admitted
    sched.add_request(make_request("D", 30))
    out, _ = step(sched)
    assert shape(out) == [("A", 6, 1), ("B", 20, 1), ("C", 3, 1), ("D", 0, 7)]
    assert out.num_batched_tokens == 10 and out.num_decode_tokens == 3
    assert [c.is_prefill for c in out.chunks] == [False, False, False, True]


def test_chunk_sizes_follow_the_budget():
    sched = make_scheduler_for_test(budget=8)
    sched.add_request(make_request("A", 25, max_tokens=2))
    sizes = [shape(step(sched)[0]) for _ in range(5)]
    assert sizes == [[("A", 0, 8)], [("A", 8, 8)], [("A", 16, 8)], [("A", 24, 1)], [("A", 25, 1)]]
    assert not sched.has_unfinished_requests()


def test_chunk_token_ids_and_timestamps():
    sched = make_scheduler_for_test(budget=3)
    r = make_request("A", 5, max_tokens=3)
    sched.add_request(r)
    out, _ = step(sched, now=1.0)
    assert out.chunks[0].token_ids == [100, 101, 102] and r.first_scheduled_time == 1.0
    out, _ = step(sched, now=2.0)
    assert out.chunks[0].token_ids == [103, 104] and r.token_times == [2.0]
    out, _ = step(sched, now=3.0, token=9)
    assert out.chunks[0].token_ids == [TOKEN] and not out.chunks[0].is_prefill
    assert r.first_scheduled_time == 1.0 and r.token_times == [2.0, 3.0]
    assert r.output_token_ids == [TOKEN, 9]


def test_fcfs_admission_never_skips_the_head():
    # Block size 1: one block per token. A holds 15 of 20 blocks, B (10) can't
    # fit, and C (2) could, but must not overtake B.
    sched = make_scheduler_for_test(budget=100, num_blocks=20, block_size=1)
    sched.add_request(make_request("A", 15, max_tokens=5))
    step(sched)
    sched.add_request(make_request("B", 10, max_tokens=1))
    sched.add_request(make_request("C", 2, max_tokens=1))
    out, _ = step(sched)
    assert shape(out) == [("A", 15, 1)]
    assert [r.request_id for r in sched.waiting] == ["B", "C"]
    finished = run_until_done(sched)
    assert [r.request_id for r in finished] == ["A", "B", "C"]


def test_max_num_seqs_limits_admission():
    sched = make_scheduler_for_test(max_num_seqs=2)
    for rid in "ABC":
        sched.add_request(make_request(rid, 2, max_tokens=2))
    out, _ = step(sched)
    assert [c.request_id for c in out.chunks] == ["A", "B"] and sched.num_waiting == 1
    out, finished = step(sched)
    assert [r.request_id for r in finished] == ["A", "B"]
    out, _ = step(sched)
    assert [c.request_id for c in out.chunks] == ["C"]


# ---- preemption ----------------------------------------------------------------
def test_preemption_requeues_at_front_and_preserves_outputs():
    # 6 blocks of 2 tokens; A and B each need 4 blocks at their longest.
    sched = make_scheduler_for_test(budget=16, num_blocks=6, block_size=2)
    a, b, c = (make_request(rid, 4, max_tokens=5) for rid in "ABC")
    sched.add_request(a)
    sched.add_request(b)
    step(sched, now=0.0)
    sched.add_request(c)
    step(sched, now=1.0)  # decodes fill the cache: C cannot be admitted
    out, _ = step(sched, now=2.0)
    assert [x.request_id for x in out.chunks] == ["A", "B"] and sched.num_waiting == 1
    out, _ = step(sched, now=3.0)  # A needs a 4th block: B, the newest, is preempted
    assert out.preempted == ["B"] and shape(out) == [("A", 6, 1)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.output_token_ids == [TOKEN] * 3
    assert sched.block_manager.block_table("B") == []
    assert [r.request_id for r in sched.waiting] == ["B", "C"]
    outputs_before = list(b.output_token_ids)
    finished = run_until_done(sched)
    assert [r.request_id for r in finished] == ["A", "B", "C"]
    for r in (a, b, c):
        assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 5
    assert b.output_token_ids[:3] == outputs_before and b.first_scheduled_time == 0.0
    assert sched.block_manager.num_free_blocks == 6


def test_recompute_chunk_covers_prompt_and_outputs():
    sched = make_scheduler_for_test(budget=16, num_blocks=6, block_size=2)
    b = make_request("B", 4, max_tokens=5)
    sched.add_request(make_request("A", 4, max_tokens=5))
    sched.add_request(b)
    outs = [step(sched, float(i))[0] for i in range(8)]
    recompute = [c for o in outs for c in o.chunks if c.request is b and c.start == 0][1]
    assert recompute.num_tokens == 7 and recompute.samples and recompute.is_prefill
    assert recompute.token_ids == [100, 101, 102, 103] + [TOKEN] * 3


def test_preempting_an_already_scheduled_request_returns_its_tokens():
    # Stall-free batching keeps any partial prefill at the tail of `running`;
    # swap the order by hand to reach the path other policies can take.
    sched = make_scheduler_for_test(budget=4, num_blocks=8, block_size=1)
    b, a = make_request("B", 2, max_tokens=3), make_request("A", 6, max_tokens=1)
    sched.add_request(b)
    step(sched)
    sched.add_request(a)
    assert shape(step(sched)[0]) == [("B", 2, 1), ("A", 0, 3)]
    sched.running.reverse()
    out = sched.schedule(2.0)  # B's decode takes the last free block; A's chunk evicts B
    assert out.preempted == ["B"] and shape(out) == [("A", 3, 3)]
    assert out.num_batched_tokens == 3 and sched.running == [a]
    sched.update(out, {"A": TOKEN}, 2.0)
    assert run_until_done(sched) == [b] and b.num_output_tokens == 3


def test_batch_remove_gives_budget_back():
    batch = Batch(token_budget=5)
    r = make_request("A", 4)
    batch.add(ScheduledChunk(r, 0, 4, [0]))
    assert batch.budget_left == 1
    batch.remove("A")
    batch.remove("A")
    assert batch.budget_left == 5 and not batch.chunks


# ---- abort and finish --------------------------------------------------------
def test_abort_frees_blocks_and_update_skips_the_chunk():
    sched = make_scheduler_for_test(budget=8)
    a, b, c = make_request("A", 4), make_request("B", 4), make_request("C", 40)
    for r in (a, b, c):
        sched.add_request(r)
    out = sched.schedule(0.0)
    assert sched.abort_request("A") is a and a.status is RequestStatus.FINISHED_ABORTED
    assert sched.block_manager.block_table("A") == []
    assert sched.abort_request("C") is c and list(sched.waiting) == []  # waiting one too
    assert sched.abort_request("A") is None and sched.abort_request("nope") is None
    finished = sched.update(out, {"A": TOKEN, "B": TOKEN}, 0.0)
    assert finished == [] and a.output_token_ids == [] and b.output_token_ids == [TOKEN]
    assert sched.running == [b] and a.finish_reason == "abort"
    sched.block_manager.check_invariants()
    run_until_done(sched)
    assert sched.block_manager.num_free_blocks == 64


def test_finish_request_for_stop_strings():
    sched = make_scheduler_for_test()
    r = make_request("A", 4)
    sched.add_request(r)
    step(sched)
    with pytest.raises(ValueError):
        sched.finish_request("A", RequestStatus.RUNNING)
    sched.finish_request("A", RequestStatus.FINISHED_STOPPED)
    sched.finish_request("A", RequestStatus.FINISHED_STOPPED)  # no-op the second time
    assert r.finish_reason == "stop" and not sched.has_unfinished_requests()
    assert sched.block_manager.num_free_blocks == 64
    sched.add_request(make_request("A", 4))  # the id is free again


# ---- stop conditions ---------------------------------------------------------
@pytest.mark.parametrize("kwargs, token, n_out, status", [
    (dict(eos=frozenset({TOKEN})), TOKEN, 1, "stop"),
    (dict(eos=frozenset({TOKEN}), ignore_eos=True), TOKEN, 6, "length"),
    (dict(eos=frozenset({TOKEN}), min_tokens=3), TOKEN, 3, "stop"),
    (dict(stop_token_ids=[TOKEN]), TOKEN, 1, "stop"),
    (dict(stop_token_ids=[TOKEN], ignore_eos=True), TOKEN, 1, "stop"),
    (dict(eos=frozenset({5}), stop_token_ids=[6]), TOKEN, 6, "length"),
])
def test_stop_conditions(kwargs, token, n_out, status):
    sched = make_scheduler_for_test()
    r = make_request("A", 3, max_tokens=6, **kwargs)
    sched.add_request(r)
    finished = []
    for i in range(20):
        finished += step(sched, float(i), token=token)[1]
    assert finished == [r] and r.num_output_tokens == n_out and r.finish_reason == status
    assert sched.block_manager.num_free_blocks == 64


def test_max_model_len_caps_the_output():
    sched = make_scheduler_for_test(max_model_len=13)
    r = make_request("A", 10, max_tokens=None)
    sched.add_request(r)
    assert run_until_done(sched) == [r]
    assert r.num_output_tokens == 3 and r.finish_reason == "length"


# ---- admission errors -----------------------------------------------------------
def test_add_request_errors():
    sched = make_scheduler_for_test(max_model_len=32, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(make_request("e", 0))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("long", 32))
    with pytest.raises(ValueError, match="KV cache has only 4 blocks"):
        sched.add_request(make_request("big", 10, max_tokens=8))  # 17 cached tokens
    sched.add_request(make_request("ok", 10, max_tokens=7))  # 16 cached tokens fit exactly
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("ok", 3))
    done = make_request("done", 3)
    done.status = RequestStatus.FINISHED_STOPPED
    with pytest.raises(ValueError, match="not new"):
        sched.add_request(done)
    assert [r.request_id for r in sched.waiting] == ["ok"]


def test_add_request_rejects_a_first_chunk_blocked_by_the_watermark():
    sched = make_scheduler_for_test(budget=8, num_blocks=10, block_size=1, watermark=0.5)
    with pytest.raises(ValueError, match="watermark"):
        sched.add_request(make_request("A", 7, max_tokens=1))
    sched.add_request(make_request("B", 5, max_tokens=1))


def test_update_rejects_misuse():
    sched = make_scheduler_for_test()
    sched.add_request(make_request("A", 4))
    out = sched.schedule(0.0)
    with pytest.raises(KeyError, match="no sampled token"):
        sched.update(out, {}, 0.0)
    sched2 = make_scheduler_for_test()
    sched2.add_request(make_request("A", 4))
    out = sched2.schedule(0.0)
    sched2.update(out, {"A": TOKEN}, 0.0)
    with pytest.raises(RuntimeError, match="applied twice"):
        sched2.update(out, {"A": TOKEN}, 0.0)


def test_make_scheduler_rejects_unknown_policy():
    config = SchedulerConfig()
    config.policy = "nope"
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_scheduler(config, BlockManager(4, 4))


def test_empty_schedule():
    sched = make_scheduler_for_test()
    out = sched.schedule(0.0)
    assert out.is_empty and out.num_batched_tokens == 0 and out.preempted == []
    assert sched.update(out, {}, 0.0) == []


def test_queue_counts():
    sched = make_scheduler_for_test(budget=4)
    sched.add_request(make_request("A", 4))
    sched.add_request(make_request("B", 4))
    assert (sched.num_waiting, sched.num_running, sched.has_unfinished_requests()) == (2, 0, True)
    out, _ = step(sched)
    assert (sched.num_waiting, sched.num_running, out.num_seqs) == (1, 1, 1)


def test_chunk_must_lie_inside_the_request():
    r = make_request("A", 4)
    for start, n in ((0, 0), (-1, 2), (2, 3)):
        with pytest.raises(ValueError, match="outside"):
            ScheduledChunk(r, start, n, [0])


# ---- the scheduler stays pure Python ---------------------------------------------
_PURE_STALLFREE_MODULES = {"stallfree.request", "stallfree.sampling_params", "stallfree.config",
                           "stallfree.outputs", "stallfree.attention_plan",
                           "stallfree.structured_outputs", "stallfree.kernel_ops"}


def test_scheduler_imports_only_the_stdlib_and_pure_modules():
    """Follows every import from stallfree/scheduler/*.py (statically, with ast)."""
    root = pathlib.Path(importlib.util.find_spec("stallfree").submodule_search_locations[0])
    pending = [p for p in (root / "scheduler").glob("*.py")]
    seen: set[pathlib.Path] = set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        parts = ["stallfree", *path.relative_to(root).with_suffix("").parts]
        package = parts[:-1]  # what a relative import of level 1 names
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                top = target.split(".")[0]
                if top != "stallfree":
                    assert top in sys.stdlib_module_names, f"{path.name} imports {target}"
                    continue
                if target.startswith("stallfree.scheduler"):
                    sub = root.joinpath(*target.split(".")[1:])
                    pending.append(sub / "__init__.py" if sub.is_dir() else sub.with_suffix(".py"))
                else:
                    assert target in _PURE_STALLFREE_MODULES, f"{path.name} imports {target}"
                    pending.append(root / f"{target.split('.')[1]}.py")
    assert len(seen) >= 8  # scheduler files plus request, sampling_params, config
