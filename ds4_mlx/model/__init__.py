"""The DeepSeek V4 Flash graph: hyper-connections, attention, MoE and their assembly (MODEL.md §4)."""

from .model import Block, Model

__all__ = ["Block", "Model"]
