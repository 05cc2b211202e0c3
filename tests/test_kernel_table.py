"""The kernel table (stallfree/model/kernel_table.py): each op's implementation chosen from
the machine's facts, the dtype and the `kernels` setting, with the reason; overrides per
engine; `stallfree info` printing it."""
from __future__ import annotations

import pytest
import torch

from kernel_paths import REFERENCE
from stallfree.cli import main as cli_main
from stallfree.config import EngineConfig
from stallfree.kernel_ops import KERNEL_OPS, parse_kernels
from stallfree.model import load_model
from stallfree.model.kernel_table import KernelFacts, choose_kernels
from stallfree.model.kernels import unavailable_reason

NO_AMX = "this CPU lacks amx_tile and amx_bf16"
AMX_CPU = KernelFacts("amx_bf16 amx_tile avx512_bf16", None, None, None, None)
BF16_CPU = KernelFacts("avx512_bf16", None, NO_AMX, None, None)
AVX2_CPU = KernelFacts("avx2 fma", None, NO_AMX, "this CPU lacks avx512_bf16",
                       "oneDNN's bf16 path needs avx512bw")
NO_LIBRARY = KernelFacts("avx2", "no compiler", "kernels not built", "kernels not built", None)


def _impls(facts: KernelFacts, dtype: torch.dtype, **kwargs) -> dict[str, str]:
    table = choose_kernels(dtype=dtype, facts=facts, **kwargs)
    return {op: choice.impl for op, choice in table.items()}


def test_each_cpu_class_gets_its_fastest_paths_and_the_reasons_name_what_is_missing():
    amx = _impls(AMX_CPU, torch.bfloat16)
    assert (amx["matmul_bf16"], amx["decode_attention"], amx["prefill_attention"],
            amx["layer_loop"]) == ("amx", "amx", "amx", "cpp")
    vectors = choose_kernels(dtype=torch.bfloat16, facts=BF16_CPU)
    assert vectors.matmul_bf16.impl == "avx512_bf16" and NO_AMX in vectors.matmul_bf16.reason
    assert vectors.decode_attention.impl == vectors.prefill_attention.impl == "vectors"
    assert _impls(AMX_CPU, torch.float32)["decode_attention"] == "vectors"  # a float32 cache
    avx2 = choose_kernels(dtype=torch.bfloat16, facts=AVX2_CPU)
    assert avx2.matmul_bf16.impl == "torch" and avx2.matmul_bf16_few_rows.impl == "skinny"
    assert avx2.prefill_attention.impl == "torch" and "avx512_bf16" in \
        avx2.prefill_attention.reason
    assert avx2.layer_loop.impl == "python"
    assert _impls(AVX2_CPU, torch.float32)["layer_loop"] == "cpp"  # float32 packs everywhere
    bare = _impls(NO_LIBRARY, torch.float32)  # oneDNN alone needs no kernel library
    assert bare.pop("matmul_bf16") == "onednn" and set(bare.values()) == {"torch", "python"}


def test_device_parallelism_and_shapes_keep_the_reference_paths():
    assert set(_impls(AMX_CPU, torch.bfloat16, device_type="cuda").values()) == \
        {"torch", "python"}
    with pytest.raises(ValueError, match="not a CPU"):
        choose_kernels({"norm": "kernel"}, device_type="cuda", facts=AMX_CPU)
    tp = choose_kernels(dtype=torch.bfloat16, tp_size=2, facts=AMX_CPU)
    assert tp.layer_loop.impl == "python" and "tensor parallelism" in tp.layer_loop.reason
    odd = _impls(BF16_CPU, torch.bfloat16, head_dim=80)
    assert odd["decode_attention"] == odd["prefill_attention"] == odd["rope_cache"] == "torch"


def test_overrides_are_checked_taken_and_said():
    table = choose_kernels({"decode_attention": "torch", "layer_loop": "python"},
                           dtype=torch.bfloat16, facts=AMX_CPU)
    assert table.decode_attention.impl == "torch" and "asked for" in \
        table.decode_attention.reason
    assert table.prefill_attention.impl == "amx"  # the others keep their defaults
    with pytest.raises(ValueError, match="cannot run here: this CPU lacks"):
        choose_kernels({"matmul_bf16": "amx"}, facts=BF16_CPU)
    with pytest.raises(ValueError, match="norm runs in torch"):
        choose_kernels({"norm": "torch", "layer_loop": "cpp"}, facts=BF16_CPU)
    with pytest.raises(ValueError, match="no op 'attention'"):
        choose_kernels({"attention": "torch"}, facts=BF16_CPU)
    with pytest.raises(ValueError, match="has no implementation 'gpu'"):
        parse_kernels("norm=gpu")
    with pytest.raises(ValueError, match="op=impl"):
        parse_kernels("norm")
    assert parse_kernels(" norm=torch, ,argmax=torch") == {"norm": "torch", "argmax": "torch"}


def test_the_setting_is_one_engine_option_and_one_flag():
    from stallfree.cli import build_parser

    assert EngineConfig.from_kwargs(kernels="norm=torch").kernels == {"norm": "torch"}
    assert EngineConfig.from_kwargs(kernels={"norm": "torch"}).kernels == {"norm": "torch"}
    assert EngineConfig().kernels == {}
    with pytest.raises(ValueError, match="no op"):
        EngineConfig.from_kwargs(kernels={"mlp": "torch"})
    args = build_parser().parse_args(["generate", "--kernels", "layer_loop=python", "hi"])
    assert args.kernels == {"layer_loop": "python"}


@pytest.mark.skipif(unavailable_reason() is not None, reason="kernels not built")
def test_two_models_in_one_process_keep_their_own_tables(tiny_model):
    fast, _ = load_model(tiny_model, torch.float32, "cpu")
    slow, _ = load_model(tiny_model, torch.float32, "cpu", kernels=REFERENCE)
    assert fast.kernels.matmul_f32.impl == "f32" and fast.model.norm.kernels is fast.kernels
    assert {c.impl for _, c in slow.kernels.items()} == {"torch", "python"}
    assert all(m.packed is None for m in slow.modules() if hasattr(m, "packed"))
    assert fast.kernels.matmul_f32.impl == "f32"  # unchanged by the second load


def test_stallfree_info_prints_the_hardware_and_the_table(capsys):
    assert cli_main(["info", "--dtype", "float32", "--kernels", "argmax=torch"]) == 0
    out = capsys.readouterr().out
    assert "vector flags" in out and "kernel library" in out and "kernel table" in out
    lines = {line.split()[0]: line.split()[1] for line in out.splitlines()
             if line.startswith("  ") and line.split()[0] in KERNEL_OPS}
    assert lines.keys() == KERNEL_OPS.keys() and lines["argmax"] == "torch"
