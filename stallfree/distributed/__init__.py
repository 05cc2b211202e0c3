"""Tensor and pipeline parallelism: worker processes joined by torch.distributed."""
