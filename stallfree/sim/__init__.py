"""Simulator: the engine's own scheduler on a virtual clock with predicted iteration times.

`stallfree simulate` (sim/cli.py) answers capacity questions for GPUs we do not
have; `stallfree profile` (sim/profile.py) measures this machine so the same
simulator can predict it. See docs/simulation.md.
"""
from .cost_model import BatchShape, ConstantCostModel, CostModel, ProfiledCostModel
from .hardware import GPUS, MODELS, GpuSpec, ModelSpec
from .simulator import SimConfig, SimResult, Simulator, simulate

__all__ = ["GPUS", "MODELS", "BatchShape", "ConstantCostModel", "CostModel", "GpuSpec",
           "ModelSpec", "ProfiledCostModel", "SimConfig", "SimResult", "Simulator", "simulate"]
