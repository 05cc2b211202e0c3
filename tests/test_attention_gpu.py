"""Paged attention on a GPU against the CPU reference path, over the same batches: decodes
from 1 to 4,096 tokens in several length groups, prefill chunks over a cached prefix, GQA
groups and block sizes, random block tables. They need CUDA; `benchmarks/gpu_check.sh`
runs them on a GPU machine."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_batch import Batch, rel_err

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device on this machine (benchmarks/gpu_check.sh runs these on a GPU)")
FP32_TOL = 1e-5


def _on_gpu_and_cpu(batch: Batch, seqs: list[tuple[int, int, list[int]]]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(GPU output, CPU reference output, float32 truth) of one batch from one cache state;
    checks both wrote the same new K/V."""
    qkv = batch.qkv(sum(n for _, n, _ in seqs))
    start = batch.cache.clone()
    exact = Batch((batch.hq, batch.hkv, batch.dim), block_size=batch.block_size, num_blocks=1)
    exact.cache = start.to(torch.float32, copy=True)  # its run writes the new K/V: not into start
    truth = exact.attend(seqs, False, tuple(t.float() for t in qkv))
    cpu = batch.attend(seqs, False, qkv)
    written = batch.cache
    batch.cache = start.to("cuda")
    gpu = batch.attend(seqs, True, qkv).cpu()
    assert torch.equal(batch.cache.cpu(), written), "the GPU wrote other K/V or other slots"
    batch.cache = written
    return gpu, cpu, truth


def _check(gpu: torch.Tensor, cpu: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype
           ) -> None:
    assert gpu.dtype == cpu.dtype == dtype and gpu.shape == cpu.shape
    if dtype == torch.float32:
        assert rel_err(gpu, cpu) < FP32_TOL
    else:  # both round to bf16 on the way; each stays within its rounding of the truth
        assert rel_err(gpu, truth) < 2e-2 and rel_err(cpu, truth) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (4, 4, 64)],
                         ids=lambda h: "q{}_kv{}_d{}".format(*h))
def test_mixed_batches_on_the_gpu_match_the_cpu_reference(heads, dtype):
    batch = Batch(heads, dtype, num_blocks=1100)
    first = batch.table(64)
    batch.attend([(0, 40, first)], False, batch.qkv(40))  # a cached prefix of 40 tokens
    seqs = [(40, 24, first), (0, 33, batch.table(33))] + batch.decodes(
        [1, 2, 17, 100, 511, 1000, 4096])
    gpu, cpu, truth = _on_gpu_and_cpu(batch, seqs)
    _check(gpu, cpu, truth, dtype)
    _check(gpu[57:], cpu[57:], truth[57:], dtype)  # the decodes on their own


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contexts=st.lists(st.integers(1, 700), min_size=1, max_size=12),
       heads=st.sampled_from([(9, 3, 64), (8, 2, 64), (4, 2, 16)]),
       block_size=st.sampled_from([8, 16, 32]), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_property_any_decode_batch_on_the_gpu_matches_the_cpu_reference(
        contexts, heads, block_size, seed, dtype):
    batch = Batch(heads, dtype, block_size=block_size, num_blocks=1200, seed=seed)
    gpu, cpu, truth = _on_gpu_and_cpu(batch, batch.decodes(contexts))
    _check(gpu, cpu, truth, dtype)
