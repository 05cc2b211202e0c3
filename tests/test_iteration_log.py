"""Iteration records: what the engine logs per batch, the JSON-lines log, and its replay."""
from __future__ import annotations

import json

import pytest

from stallfree.iteration_log import IterationLog, read_iteration_log
from stallfree.outputs import IterationRecord
from stallfree.sim.cost_model import ConstantCostModel
from stallfree.sim.replay import format_replay, replay


def _record(start: float, cpu: float, prefills=(), decodes=()) -> IterationRecord:
    return IterationRecord(start, start + 2 * cpu, sum(n for n, _ in prefills), len(decodes),
                           len(prefills) + len(decodes), 0, ("a",), (),
                           tuple(prefills), tuple(decodes), len(decodes) + len(prefills), cpu)


def test_offline_engine_records_each_batch(default_llm):
    from stallfree import SamplingParams

    llm = default_llm
    llm.engine.iterations.clear()
    outs = llm.generate(["The capital of France is", "1, 2, 3,"],
                        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    records = list(llm.engine.iterations)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    assert sum(r.num_prefill_tokens for r in records) == prompt_tokens
    assert sum(r.num_sampled for r in records) == 10
    for r in records:
        assert (sum(n for n, _ in r.prefill_chunks) + len(r.decode_contexts)
                == r.num_prefill_tokens + r.num_decode_tokens)
        # The engine thread's CPU time: positive, and no more than the wall time allows.
        assert 0 < r.cpu_time <= (r.end - r.start) * 1.05 + 1e-3
    last = records[-1]
    # The decode that samples the 5th token feeds the 4th: it attends to prompt + 4.
    assert sorted(last.decode_contexts) == sorted(len(o.prompt_token_ids) + 4 for o in outs)


def test_log_round_trip_and_bad_lines(tmp_path):
    path = tmp_path / "it.jsonl"
    log = IterationLog(path)
    log.header(block_size=8, threads=1, pipeline_depth=1)
    records = [_record(1.0, 0.25, prefills=[(16, 0), (8, 32)]), _record(2.0, 0.1, decodes=[5, 9])]
    for r in records:
        log.write(r)
    log.close()
    log.write(records[0])  # after close: dropped, not an error
    settings, back = read_iteration_log(path)
    assert settings == {"iteration_log": 1, "block_size": 8, "threads": 1, "pipeline_depth": 1}
    assert back == [r.__class__(**{**r.__dict__, "request_ids": ()}) for r in records]
    assert "request_ids" not in path.read_text()
    good = path.read_text()
    path.write_text(good + json.dumps({"start": 1, "bogus": 2}) + "\n")
    with pytest.raises(ValueError, match=r"it.jsonl:4: .*bogus"):
        read_iteration_log(path)
    # A record whose chunks do not add up (say, from a version without them) is refused.
    row = json.loads(good.splitlines()[1]) | {"prefill_chunks": []}
    path.write_text(good + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"it.jsonl:4: .*add up"):
        read_iteration_log(path)


def test_one_token_chunks_attend_as_decodes():
    """A prompt chunk of one token runs in the kernel's decode path: the record and the
    simulator's batch shape both count it with the decodes."""
    from stallfree.request import Request
    from stallfree.sampling_params import SamplingParams
    from stallfree.scheduler.output import ScheduledChunk, SchedulerOutput
    from stallfree.sim.cost_model import BatchShape

    params = SamplingParams(max_tokens=4)
    prompt = Request("p", list(range(1, 601)), params, 0.0)
    decode = Request("d", list(range(1, 11)), params, 0.0)
    out = SchedulerOutput([ScheduledChunk(prompt, 499, 1, []), ScheduledChunk(decode, 9, 1, [])])
    assert out.chunks[0].is_prefill  # the scheduler's view: still the prompt
    record = out.iteration_record(0.0)
    assert record.prefill_chunks == () and record.decode_contexts == (500, 10)
    assert record.num_prefill_tokens == 1 and record.num_decode_tokens == 1
    assert BatchShape.from_output(out).decode_contexts == (500, 10)


def test_replay_compares_cpu_time_with_the_cost_model():
    cost = ConstantCostModel(base=0.1, per_token=0.01)
    records = [_record(0.0, 0.2, prefills=[(10, 0)]),  # predicted 0.1 + 0.1 = 0.2
               _record(1.0, 0.1, decodes=[5, 6]),  # predicted 0.12: +20%
               _record(2.0, 0.2, decodes=[7] * 6)]  # predicted 0.16: -20%
    result = replay(records, cost)
    rows = {r["batches"]: r for r in result["rows"]}
    assert rows["with prefill"]["error"] == pytest.approx(0.0)
    assert rows["decode-only"]["measured_cpu_s"] == pytest.approx(0.3)
    assert rows["decode-only"]["predicted_s"] == pytest.approx(0.28)
    assert rows["decode x1-4"]["error"] == pytest.approx(0.2)
    assert rows["decode x5-8"]["error"] == pytest.approx(-0.2)
    assert rows["all"]["iterations"] == 3
    assert result["wall_per_cpu"] == pytest.approx(2.0)
    assert "decode x5-8" in format_replay(result)


def test_replay_command_reads_a_log_with_a_cpu_profile(tmp_path, capsys):
    from stallfree.cli import main as cli_main
    from test_sim_cpu_profile import write_cpu_profile

    write_cpu_profile(tmp_path / "prof", "stallfree.paged_attention")
    (tmp_path / "prof" / "cpu" / "host.json").write_text('{"wall_per_cpu": 3.0}')
    log = IterationLog(tmp_path / "it.jsonl")
    log.header(block_size=16, threads=2, pipeline_depth=1)
    log.write(_record(0.0, 0.05, decodes=[100] * 8))
    log.close()
    args = ["simulate", "--gpu", "cpu", "--profile-dir", str(tmp_path / "prof"), "--model",
            "smollm2-135m", "replay", str(tmp_path / "it.jsonl"),
            "--result-file", str(tmp_path / "r.json")]
    assert cli_main(args) == 0
    printed = capsys.readouterr()
    assert "decode-only" in printed.out and "2 compute threads" in printed.err
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    # 30 layers x (8 ops x 0.01 ms + attention 0.8 ms) + embedding, head and 1 ms of CPU:
    # in CPU seconds, without the profile's host factor of 3.
    assert rows[0]["predicted_s"] == pytest.approx((30 * (0.08 + 0.8) + 0.02 + 1.0) / 1e3,
                                                   rel=0.02)
    assert cli_main([*args[:-3], str(tmp_path / "missing.jsonl")]) == 2
