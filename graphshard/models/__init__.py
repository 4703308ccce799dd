"""Reference models for graphshard: a Llama-style decoder and a small odd-sized MLP."""

from graphshard.models.llama import CONFIGS, Llama, LlamaConfig, LlamaOutput, llama_config
from graphshard.models.mlp import MLPOutput, OddMLP

__all__ = [
    "CONFIGS",
    "Llama",
    "LlamaConfig",
    "LlamaOutput",
    "llama_config",
    "MLPOutput",
    "OddMLP",
]
