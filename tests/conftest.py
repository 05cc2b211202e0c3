"""Shared fixtures: the default model is loaded once per test session."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def default_llm():
    """The default model in float32, its GGUF weights dequantized at load: the reference
    model. Token-for-token equality with transformers, chunked with unchunked and batched
    with alone are float32 claims (bf16 rounds differently per batch shape;
    tests/test_dtype.py bounds its disagreement; the quantized kernels quantize activations,
    tests/test_quantized_model.py bounds theirs)."""
    from stallfree import LLM

    return LLM(max_model_len=4096, dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def quantized_llm():
    """The default model as it serves by default: its Q4_1/Q8_0 weights kept quantized."""
    from stallfree import LLM

    llm = LLM(max_model_len=4096, dtype="float32", quantization="auto")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' own model on the same GGUF weights: the correctness reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from stallfree.model.loader import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A random-weight 2-layer Llama (see tiny_models.py): cheap to load and to serve."""
    from tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def bf16_llm():
    """The default model in bfloat16, where the CPU computes it in hardware."""
    # By the flags, not the timed probe: under load the probe may call bf16 slow, and the
    # agreement must be checked wherever the CPU computes bf16 in hardware. A GPU, where the
    # engine runs when there is one, computes bf16 in hardware.
    import torch

    from stallfree.executor import hardware

    if not torch.cuda.is_available() and not set(hardware.BF16_FLAGS) & hardware.cpu_flags():
        pytest.skip(f"the CPU has none of {hardware.BF16_FLAGS}: bf16 would take minutes")
    from stallfree import LLM

    llm = LLM(max_model_len=4096, dtype="bfloat16", quantization="none")
    yield llm
    llm.shutdown()


@pytest.fixture
def serve():
    """`serve(engine=None, **build_app_args)`: the API app around `engine` (a fresh
    FakeEngine if None), served as model "fake" by uvicorn in a thread of this process;
    every server started is stopped after the test."""
    from server_utils import FakeEngine, ThreadServer
    from stallfree.server.api import build_app

    servers = []

    def start(engine=None, **kwargs) -> ThreadServer:
        server = ThreadServer(build_app(engine or FakeEngine(), "fake", **kwargs))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
