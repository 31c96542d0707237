"""The DeepSeek V4 Flash graph: hyper-connections, attention, MoE, the fused operations they run (kernels on
the GPU, pure MLX elsewhere) and their assembly (docs/model.md §4)."""

from .model import Block, Model

__all__ = ["Block", "Model"]
