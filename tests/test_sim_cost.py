"""Cost model: profile interpolation, proxies and roofline, model sizes, calibration."""
from __future__ import annotations

import json

import pytest

from stallfree.sim import profile_store as P
from stallfree.sim.calibrate import fit_overhead, points, predict, table
from stallfree.sim.cost_model import BatchShape, ConstantCostModel, ProfiledCostModel
from stallfree.sim.hardware import (
    CPU,
    MODELS,
    ModelSpec,
    get_gpu,
    get_model,
    kv_cache_blocks,
)
from stallfree.sim.profile_csv import stat_columns, time_stats, write_csv

A100 = get_gpu("a100")


@pytest.fixture(scope="module")
def codellama():
    return ProfiledCostModel(MODELS["codellama-34b"], A100, tp=2)


def test_interp_inside_below_above():
    xs, ys = [1.0, 3.0], [2.0, 6.0]
    assert P.interp(xs, ys, 2.0) == 4.0
    assert P.interp(xs, ys, 0.5) == 2.0  # launch-bound: never below the smallest
    assert P.interp(xs, ys, 6.0) == 12.0  # throughput-bound: proportional


def test_linear_ops_match_the_profile_at_grid_points_and_interpolate(codellama):
    prof = codellama._mlp
    at = {n: sum(prof.op_time(op, n, 2) for op in P.LAYER_OPS) for n in (1024, 1040, 1056, 4096)}
    assert codellama._linear_layer(1024) == pytest.approx(at[1024])
    lo, hi = sorted((at[1040], at[1056]))  # measured times are not always monotonic
    assert lo <= codellama._linear_layer(1050) <= hi  # 1040 is a grid point too
    assert codellama._linear_layer(8192) == pytest.approx(2 * at[4096])
    times = [codellama._linear_layer(n) for n in (1, 64, 512, 2048, 4096)]
    assert times == sorted(times)


def test_attention_grows_with_work_and_extrapolates(codellama):
    a = codellama._attn
    assert a.prefill_time(512, 0) < a.prefill_time(512, 1024) < a.prefill_time(512, 3000)
    assert a.prefill_time(512, 0) < a.prefill_time(600, 0) < a.prefill_time(1024, 0)
    # Beyond the 4096-token grid: causal work c * (k + c / 2) quadruples from 4096 to 8192.
    assert a.prefill_time(8192, 0) == pytest.approx(4 * a.prefill_time(4096, 0))
    assert a.prefill_time(10, 0) == a.prefill_time(64, 0)  # launch-bound below the grid
    assert a.decode_time(8, 1024) < a.decode_time(64, 1024) < a.decode_time(64, 3000)
    assert a.decode_time(64, 8064) == pytest.approx(2 * a.decode_time(64, 4032))
    assert a.decode_time(256, 1024) == pytest.approx(2 * a.decode_time(128, 1024))


def test_codellama_prefill_matches_the_consistency_check_in_sources(codellama):
    # shared/data/SOURCES.md: summed operator medians of CodeLlama-34B TP2 (mlp profile, the
    # TP2 attention file, two all-reduces a layer) give 192 / 363 / 765 ms.
    for tokens, ms in ((1024, 192), (2048, 363), (4096, 765)):
        stage = codellama.iteration(BatchShape.prefill(tokens)).stage
        assert stage * 1e3 == pytest.approx(ms, rel=0.03)


def test_sources_exact_proxy_and_roofline():
    assert "exact shape" in ProfiledCostModel(MODELS["mistral-7b"], A100).sources["linear"]
    yi = ProfiledCostModel(MODELS["yi-34b"], A100, tp=2).sources["linear"]
    assert "CodeLlama-34b" in yi and "proxy" in yi
    falcon = ProfiledCostModel(MODELS["falcon-180b"], A100, tp=4, pp=2)
    assert falcon.sources["linear"].startswith("roofline")
    cost = falcon.iteration(BatchShape.prefill(512))
    assert cost.send > 0 and 0.05 < cost.stage < 1.0
    h100 = ProfiledCostModel(MODELS["llama-2-70b"], get_gpu("h100"), tp=4)
    assert h100.sources["attention"].startswith("roofline")  # no H100 attention profile


def test_roofline_agrees_with_a_profile_within_a_factor():
    prof = ProfiledCostModel(MODELS["llama-2-70b"], A100, tp=4)
    roof = ProfiledCostModel(MODELS["llama-2-70b"], A100, tp=4, linear="roofline",
                             attention="roofline")
    for batch in (BatchShape.decode(1, 512), BatchShape.decode(64, 2048),
                  BatchShape.prefill(512), BatchShape.prefill(4096, 2048)):
        ratio = roof.iteration(batch).stage / prof.iteration(batch).stage
        assert 0.6 < ratio < 1.6, (batch, ratio)


def test_cpu_overhead_grows_with_batch():
    m = ProfiledCostModel(MODELS["mistral-7b"], A100)
    one, many = m.iteration(BatchShape.decode(1, 100)), m.iteration(BatchShape.decode(256, 100))
    assert 0 < one.cpu < many.cpu


def test_model_sizes_and_kv_capacity():
    billions = {name: MODELS[name].num_params() / 1e9 for name in MODELS}
    assert billions["mistral-7b"] == pytest.approx(7.24, abs=0.05)
    assert billions["llama-2-7b"] == pytest.approx(6.74, abs=0.05)
    assert billions["yi-34b"] == pytest.approx(34.4, abs=0.3)
    assert billions["llama-2-70b"] == pytest.approx(69.0, abs=0.3)
    assert billions["falcon-180b"] == pytest.approx(179.5, abs=1.5)
    # Mistral on one A100: ~57 GB left after weights at 0.9 utilisation, 128 KiB a token.
    blocks = kv_cache_blocks(MODELS["mistral-7b"], A100, 1, 1, 16, 0.9, 512)
    assert 25_000 < blocks < 30_000
    with pytest.raises(ValueError, match="does not fit"):
        kv_cache_blocks(MODELS["llama-2-70b"], A100, 1, 1, 16)
    assert MODELS["falcon-180b"].kv_bytes_per_token(4, 2) == 2 * 40 * 2 * 64 * 2


def test_hf_config(tmp_path):
    falcon = {"model_type": "falcon", "hidden_size": 14848, "num_hidden_layers": 80,
              "num_attention_heads": 232, "num_kv_heads": 8, "vocab_size": 65024,
              "parallel_attn": True, "new_decoder_architecture": True}
    spec = ModelSpec.from_hf_config(falcon)
    ref = MODELS["falcon-180b"]
    assert (spec.num_params(), spec.allreduces_per_layer) == (ref.num_params(), 1)
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["MistralForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
         "vocab_size": 32000, "max_position_embeddings": 32768}))
    mistral = get_model(str(tmp_path))
    assert mistral.num_params() == MODELS["mistral-7b"].num_params() and mistral.gated_mlp
    with pytest.raises(ValueError, match="unknown model"):
        get_model("no-such-model")


def test_calibration_against_the_papers_yi34b_points():
    a, b = fit_overhead()
    assert 0 < a < 0.02 and 0 < b < 0.003  # seconds per iteration, per request
    text = table()
    mean_cal = float(text.rsplit("Mean |error| (calibrated", 1)[1].split(": ")[1].split("%")[0])
    assert mean_cal < 10.0
    pts = {p.label: p for p in points()}
    plain = ProfiledCostModel(MODELS["yi-34b"], A100, tp=2)
    for n in (1024, 2048, 4096):  # prefill is within 10 % from the profiles alone
        p = pts[f"fig2 prefill {n}"]
        assert predict(plain, p) == pytest.approx(p.measured_s, rel=0.1)


def test_a_measured_profile_layout_is_read(tmp_path):
    # The files `stallfree profile` writes, with made-up numbers: 1 ms an op a layer, etc.
    model = MODELS["smollm2-135m"]
    root = tmp_path / "prof" / "cpu"
    shape = {"n_head": 9, "n_kv_head": 3, "n_embd": 576, "n_expanded_embd": 1536,
             "vocab_size": 49152, "use_gated_mlp": True, "num_tensor_parallel_workers": 1}
    ops = [*P.LAYER_OPS, "emb", "lm_head"]
    write_csv(root / "compute" / "HuggingFaceTB" / "SmolLM2-135M-Instruct" / "mlp.csv",
              [{k: v for op in ops for k, v in stat_columns(op, time_stats([n / 100])).items()}
               | shape | {"num_tokens": n} for n in (1, 100)])
    att = []
    for b, c, k in ((1, 16, 0), (1, 16, 64), (1, 64, 0), (1, 64, 64), (1, 0, 32), (1, 0, 64),
                    (4, 0, 32), (4, 0, 64)):
        kind = "attn_prefill" if c else "attn_decode"
        other = "attn_decode" if c else "attn_prefill"
        blank = {key: "" for key in stat_columns(other, time_stats([0]))}
        att.append(stat_columns(kind, time_stats([0.5])) | blank
                   | {"n_embd": 576, "n_q_head": 9, "n_kv_head": 3,
                      "num_tensor_parallel_workers": 1,
                      "batch_size": b, "prefill_chunk_size": c, "kv_cache_size": k,
                      "is_prefill": bool(c)})
    write_csv(root / "compute" / "attention_n576_q9_kv3_tp1.csv", att)
    write_csv(root / "cpu_overheads.csv", [
        {"prepare_inputs_e2e_median": ms, "model_name": model.profile_name, "batch_size": b,
         "tensor_parallel_degree": 1, "ray_comm_time_mean": 0.0} for b, ms in ((1, 2.0), (4, 5.0))])
    cost = ProfiledCostModel(model, CPU, root=tmp_path / "prof")
    it = cost.iteration(BatchShape.decode(4, 40))
    per_layer = len(P.LAYER_OPS) * 0.04e-3 + 0.5e-3
    assert it.stage == pytest.approx(30 * per_layer + 2 * 0.04e-3)
    assert it.cpu == pytest.approx(5e-3)
    assert ConstantCostModel(0.1, per_token=0.01).iteration(BatchShape.decode(4, 40)).stage \
        == pytest.approx(0.14)
