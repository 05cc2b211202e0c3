"""Simulator: the engine's own scheduler on a virtual clock with predicted iteration times.

`stallfree simulate` answers capacity questions for GPUs we do not have
(`run.py`, `capacity.py`, `replay.py`; the flags are in `stallfree/cli/simulate.py`);
`stallfree profile` (`stallfree.profiler`) measures this machine so the same
simulator can predict it. Nothing here runs tensors: the simulator only reads
profiles (`profile_store.py`). See docs/simulation.md.
"""
from .cost_model import BatchShape, ConstantCostModel, CostModel, ProfiledCostModel
from .hardware import GPUS, MODELS, GpuSpec, ModelSpec
from .simulator import SimConfig, SimResult, Simulator, simulate

__all__ = ["GPUS", "MODELS", "BatchShape", "ConstantCostModel", "CostModel", "GpuSpec",
           "ModelSpec", "ProfiledCostModel", "SimConfig", "SimResult", "Simulator", "simulate"]
