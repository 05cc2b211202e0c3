"""`stallfree profile --quick` on the default model: the files the CPU cost model reads."""
from __future__ import annotations

import json

import torch

from stallfree.cli import main as cli_main
from stallfree.model import paged_decode
from stallfree.model.kernel_table import default_kernels
from stallfree.sim import profile_store as P
from stallfree.sim.cost_model import BatchShape, ProfiledCostModel
from stallfree.sim.hardware import CPU, MODELS


def test_quick_profile_feeds_the_cpu_cost_model(tmp_path):
    # float32 named: dtype auto would pick bf16 on some machines and fp32 on others.
    assert cli_main(["profile", "--quick", "--dtype", "float32", "--out", str(tmp_path)]) == 0
    dev = tmp_path / "cpu"
    host = json.loads((dev / "host.json").read_text())
    # A measured ratio: positive, whatever the machine's load (no threshold on timing).
    assert host["wall_per_cpu"] > 0 and host["threads"] >= 1
    attention = P.attention_paths(tmp_path, "cpu")
    assert len(attention) == 1
    profile = P.load_attention(attention[0])
    # Decodes as the engine runs them: read in place by the kernel where it is built (cost
    # by mean context), else gathered and padded per length group; fp32 KV either way.
    in_place = paged_decode.usable(torch.zeros(2, 1, 16, 3, 64), default_kernels())
    assert profile.padded_decode is not in_place and profile.kv_dtype_bytes == 4
    cost = ProfiledCostModel(MODELS["smollm2-135m"], CPU, root=tmp_path)
    assert cost.slowdown == host["wall_per_cpu"]
    # Positive and finite from the measured rows; no order between them is asserted, as
    # measured times on a shared machine need not keep one (batch 1 once cost more than 4).
    shapes = [BatchShape.decode(1, 64), BatchShape.decode(4, 64), BatchShape.prefill(128)]
    assert all(0 < cost.iteration(s).total() < 60 for s in shapes)


def test_profile_takes_dtype_auto_as_serve_does():
    # A script that profiles and serves with one --dtype must not fail on the profile.
    from stallfree.cli import build_parser

    args = build_parser().parse_args(["profile", "--dtype", "auto", "--quick"])
    assert args.dtype == "auto"
