"""The CPU cost model on hand-made profiles: decode attention padded to each length group's
longest (the torch path) or by mean context (in place), and the time outside the ops."""
from __future__ import annotations

from pathlib import Path

import pytest

from stallfree.request import Request
from stallfree.sampling_params import SamplingParams
from stallfree.scheduler.output import ScheduledChunk, SchedulerOutput
from stallfree.sim import profile_store as P
from stallfree.sim.cost_model import BatchShape, ProfiledCostModel
from stallfree.sim.hardware import CPU, MODELS
from stallfree.sim.profile_csv import read_csv, stat_columns, time_stats, write_csv

SMOL = MODELS["smollm2-135m"]
OP_MS = 0.01  # every token-level op, every token count
# Decode attention per layer (ms) by (batch, context): superlinear in context, as on this CPU.
DECODE_MS = {(1, 100): 0.1, (1, 1000): 1.0, (8, 100): 0.8, (8, 1000): 40.0}


def write_cpu_profile(root: Path, backend: str, host_ms: float = 1.0) -> None:
    """The three files `stallfree profile` writes, with the numbers above."""
    dev = root / "cpu"
    shape = {"n_head": 9, "n_kv_head": 3, "n_embd": 576, "n_expanded_embd": 1536,
             "vocab_size": 49152, "use_gated_mlp": True, "num_tensor_parallel_workers": 1}
    ops = [*P.LAYER_OPS, "emb", "lm_head"]
    write_csv(dev / "compute" / "HuggingFaceTB" / "SmolLM2-135M-Instruct" / "mlp.csv",
              [{k: v for op in ops for k, v in stat_columns(op, time_stats([OP_MS])).items()}
               | shape | {"num_tokens": n} for n in (1, 1024)])
    rows = []
    for (batch, chunk, cached), ms in [((1, 64, 0), 1.0), ((1, 64, 512), 2.0),
                                       *(((b, 0, c), ms) for (b, c), ms in DECODE_MS.items())]:
        timed, blank = ("attn_prefill", "attn_decode") if chunk else ("attn_decode",
                                                                       "attn_prefill")
        empty = {k: "" for k in stat_columns(blank, time_stats([0]))}
        rows.append(stat_columns(timed, time_stats([ms])) | empty
                    | {"n_embd": 576, "n_q_head": 9, "n_kv_head": 3,
                       "num_tensor_parallel_workers": 1, "batch_size": batch,
                       "prefill_chunk_size": chunk, "kv_cache_size": cached,
                       "is_prefill": bool(chunk), "attention_backend": backend})
    write_csv(dev / "compute" / "attention_n576_q9_kv3_tp1.csv", rows)
    write_csv(dev / "cpu_overheads.csv", [
        {"prepare_inputs_e2e_median": host_ms, "model_name": SMOL.profile_name, "batch_size": b,
         "tensor_parallel_degree": 1, "ray_comm_time_mean": 0.0} for b in (1, 8)])


@pytest.fixture
def padded(tmp_path: Path) -> ProfiledCostModel:
    write_cpu_profile(tmp_path / "padded", "stallfree.paged_attention")
    return ProfiledCostModel(SMOL, CPU, root=tmp_path / "padded")


@pytest.fixture
def varlen(tmp_path: Path) -> ProfiledCostModel:
    write_cpu_profile(tmp_path / "varlen", "flashinfer")
    return ProfiledCostModel(SMOL, CPU, root=tmp_path / "varlen")


def _decode_chunk(rid: str, context: int) -> ScheduledChunk:
    """The decode of a request whose `context` tokens are all but the last one cached."""
    req = Request(rid, list(range(1, context + 1)), SamplingParams(max_tokens=4), 0.0)
    return ScheduledChunk(req, context - 1, 1, [])


def _attention_ms(cost: ProfiledCostModel, batch: BatchShape) -> float:
    """Attention per layer: the stage time less the ops and ends (every op costs OP_MS)."""
    ops = len(P.LAYER_OPS) * OP_MS * SMOL.num_layers + OP_MS * (1 + bool(batch.num_sampled))
    return (cost.iteration(batch).stage * 1e3 - ops) / SMOL.num_layers


def test_batch_shape_keeps_each_decode_context():
    out = SchedulerOutput([_decode_chunk(str(i), c) for i, c in enumerate((100, 100, 1000))])
    b = BatchShape.from_output(out)
    assert (b.num_decodes, b.decode_context_sum, b.decode_contexts) == (3, 1200, (100, 100, 1000))
    assert b.decode_context_mean == 400
    assert BatchShape.decode(4, 100).decode_contexts == (100, 100, 100, 100)


def test_the_backend_column_says_whether_decodes_are_padded(padded, varlen):
    assert padded._attn.padded_decode and not varlen._attn.padded_decode


def test_padded_decode_costs_each_group_at_its_longest_context(padded, varlen):
    # 8 decodes close enough in length to share a group: padded to 1000 (mean 650).
    close = BatchShape.of((), (1000,) + (600,) * 7, 8)
    assert _attention_ms(padded, close) == pytest.approx(DECODE_MS[(8, 1000)])
    mean = DECODE_MS[(8, 100)] + (650 - 100) / 900 * (DECODE_MS[(8, 1000)] - DECODE_MS[(8, 100)])
    assert _attention_ms(varlen, close) == pytest.approx(mean)
    # The kernel's own grouping: the long request alone, the seven short ones together.
    split = BatchShape.of((), (1000,) + (100,) * 7, 8)
    # Seven at 100, read at 700 gathered tokens: batch 1 at 700 (0.7 ms), batch 8 at its edge.
    seven = 0.7 + 6 / 7 * (DECODE_MS[(8, 100)] - 0.7)
    assert _attention_ms(padded, split) == pytest.approx(DECODE_MS[(1, 1000)] + seven)
    # Equal contexts: both backends agree.
    same = BatchShape.decode(8, 1000)
    assert _attention_ms(padded, same) == pytest.approx(_attention_ms(varlen, same))


def test_a_profile_that_records_its_kv_dtype_caps_the_calls(tmp_path: Path):
    """With the KV element size known, the cost model cuts a group into calls as the kernel
    does: 48 decodes at 1000 tokens of fp32 SmolLM2 KV are 24 calls of 2 (2K tokens each)."""
    from stallfree.attention_plan import padded_groups

    write_cpu_profile(tmp_path / "plain", "stallfree.paged_attention")
    write_cpu_profile(tmp_path / "typed", "stallfree.paged_attention")
    path = tmp_path / "typed" / "cpu" / "compute" / "attention_n576_q9_kv3_tp1.csv"
    write_csv(path, [r | {"kv_dtype_bytes": 4} for r in read_csv(path)])
    capped = ProfiledCostModel(SMOL, CPU, root=tmp_path / "typed")
    uncapped = ProfiledCostModel(SMOL, CPU, root=tmp_path / "plain")
    assert padded_groups([1000] * 48, 16, 2 * 3 * 64 * 4) == [(2, 1000)] * 24
    batch = BatchShape.decode(48, 1000)
    capped_call, uncapped_call = (m._attn.decode_time for m in (capped, uncapped))
    assert _attention_ms(capped, batch) == pytest.approx(24e3 * capped_call(2, 1000))
    assert _attention_ms(uncapped, batch) == pytest.approx(1e3 * uncapped_call(48, 1000))


def test_between_batch_sizes_padded_rows_are_read_at_equal_gathered_tokens(padded, varlen):
    # 4 x 100 = 400 tokens: batch 1 at context 400 (0.4 ms), batch 8 at 50 (its edge, 0.8).
    assert _attention_ms(padded, BatchShape.decode(4, 100)) == pytest.approx(0.4 + 3 / 7 * 0.4)
    # A varlen kernel: both rows at context 100.
    assert _attention_ms(varlen, BatchShape.decode(4, 100)) == pytest.approx(
        DECODE_MS[(1, 100)] + 3 / 7 * (DECODE_MS[(8, 100)] - DECODE_MS[(1, 100)]))


def test_outside_the_grid_time_grows_with_the_work_and_never_shrinks(padded, varlen):
    for cost in (padded, varlen):
        assert _attention_ms(cost, BatchShape.decode(16, 2000)) == pytest.approx(
            DECODE_MS[(8, 1000)] * 4)
        assert _attention_ms(cost, BatchShape.decode(1, 10)) == pytest.approx(
            DECODE_MS[(1, 100)])


def test_host_slowdown_scales_every_iteration(tmp_path: Path):
    write_cpu_profile(tmp_path, "stallfree.paged_attention")
    quiet = ProfiledCostModel(SMOL, CPU, root=tmp_path)
    assert quiet.slowdown == 1.0  # no host.json: a core of its own
    (tmp_path / "cpu" / "host.json").write_text('{"wall_per_cpu": 2.5}')
    busy = ProfiledCostModel(SMOL, CPU, root=tmp_path)
    given = ProfiledCostModel(SMOL, CPU, root=tmp_path, slowdown=1.5)
    batch = BatchShape(((64, 512),), 8, 800, 9, (100,) * 8)
    base, slow = quiet.iteration(batch), busy.iteration(batch)
    assert (slow.cpu, slow.stage) == pytest.approx((2.5 * base.cpu, 2.5 * base.stage))
    assert given.iteration(batch).total() == pytest.approx(1.5 * base.total())
    assert busy.describe()["slowdown"] == 2.5


def test_a_deployment_passes_its_slowdown_to_the_cost_model(tmp_path: Path):
    from stallfree.sim.run import Deployment

    write_cpu_profile(tmp_path, "stallfree.paged_attention")
    dep = Deployment("smollm2-135m", "cpu", profile_dir=str(tmp_path), cpu_slowdown=1.5)
    assert dep.cost_model().slowdown == 1.5
    assert Deployment("smollm2-135m", "cpu", profile_dir=str(tmp_path)).cost_model().slowdown == 1


def test_a_negative_host_time_comes_off_the_stage(tmp_path: Path):
    # A step that costs less than its ops timed one by one (the layers in one C++ call).
    write_cpu_profile(tmp_path / "none", "stallfree.paged_decode", host_ms=0.0)
    write_cpu_profile(tmp_path / "less", "stallfree.paged_decode", host_ms=-0.5)
    batch = BatchShape.decode(1, 100)
    base = ProfiledCostModel(SMOL, CPU, root=tmp_path / "none").iteration(batch)
    less = ProfiledCostModel(SMOL, CPU, root=tmp_path / "less").iteration(batch)
    assert base.cpu == less.cpu == 0.0
    assert less.stage == pytest.approx(base.stage - 0.5e-3)
    # Measured on the whole model: a pipeline's stages share it, so an iteration counts it once.
    base2, less2 = (ProfiledCostModel(SMOL, CPU, pp=2, root=tmp_path / name).iteration(batch)
                    for name in ("none", "less"))
    assert less2.total(2) == pytest.approx(base2.total(2) - 0.5e-3)
    # However far below the ops a profile says a step is, no stage takes negative time.
    write_cpu_profile(tmp_path / "absurd", "stallfree.paged_decode", host_ms=-1e6)
    assert ProfiledCostModel(SMOL, CPU, root=tmp_path / "absurd").iteration(batch).stage == 0.0


def test_the_time_outside_the_ops_keeps_its_sign(tmp_path: Path):
    from stallfree.profiler.run import cpu_overhead_rows

    write_cpu_profile(tmp_path, "stallfree.paged_decode")
    folder = tmp_path / "cpu"
    ops = ProfiledCostModel(SMOL, CPU, root=tmp_path, slowdown=1.0)
    # Steps that cost less than their ops (the layers in one C++ call), one more than them.
    outside_ms = {1: -3.0, 2: -1.5, 4: 0.5, 8: -2.0}
    steps = {b: (ops.iteration(BatchShape.decode(b, 100)).stage + ms / 1e3, 100)
             for b, ms in outside_ms.items()}
    rows = cpu_overhead_rows(steps, SMOL, folder)
    assert [r["batch_size"] for r in rows] == list(outside_ms)
    assert [r["prepare_inputs_e2e_median"] for r in rows] == pytest.approx(
        list(outside_ms.values()))
    # Read back, a decode batch is predicted at its measured step.
    write_csv(folder / "cpu_overheads.csv", rows)
    P.load_cpu.cache_clear()  # the file at this path was read (and cached) with other values
    cost = ProfiledCostModel(SMOL, CPU, root=tmp_path, slowdown=1.0)
    for b, (seconds, ctx) in steps.items():
        assert cost.iteration(BatchShape.decode(b, ctx)).total() == pytest.approx(seconds)
