"""Which executor runs a config's model: in this process, or shard by shard in tensor- and
pipeline-parallel worker processes."""
from __future__ import annotations

import torch

from ..config import EngineConfig
from ..executor.base import Executor
from ..executor.local import LocalExecutor
from ..model.config import ModelConfig
from ..model.kernel_table import KernelTable, choose_kernels
from ..model.loader import load_model, load_model_config, planned_weights
from ..model.parallel import Shard
from ..model.quant_load import describe as describe_weights
from .distributed_executor import DistributedExecutor, threads_per_worker
from .worker import WorkerConfig


def make_executor(config: EngineConfig, device: torch.device,
                  dtype_name: str) -> tuple[Executor, ModelConfig, KernelTable, str]:
    """The executor, the model's config, its kernel table (under TP/PP, as this machine
    chooses it: each worker logs its own) and its matmul weights' types. A kernel the
    settings ask for that cannot run here fails before any weight loads."""
    parallel, dtype = config.parallel, getattr(torch, dtype_name)
    if parallel.world_size == 1:
        choose_kernels(config.kernels, dtype=dtype, device_type=device.type)
        model, model_config = load_model(config.model, dtype, device, kernels=config.kernels,
                                         quantization=config.quantization)
        return (LocalExecutor(model, model_config, dtype, device, config.seed), model_config,
                model.kernels, describe_weights(model))
    model_config = load_model_config(config.model)
    shard = Shard(tp_size=parallel.tensor_parallel_size, pp_size=parallel.pipeline_parallel_size)
    shard.check(model_config.num_hidden_layers, model_config.num_key_value_heads)
    # What every worker's load does with the weights, from the file's metadata.
    weights, quantized = planned_weights(config.model, config.quantization, device, shard)
    table = choose_kernels(config.kernels, dtype=dtype, device_type=device.type,
                           tp_size=parallel.tensor_parallel_size, head_dim=model_config.head_dim,
                           quantized=quantized)
    threads = threads_per_worker(parallel.world_size, config.threads)
    worker_config = WorkerConfig(config.model, dtype_name, device.type,
                                 parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                                 config.seed, threads, dict(config.kernels),
                                 config.quantization)
    return DistributedExecutor(worker_config, parallel), model_config, table, weights
