"""megatron-core models of the Llama family with the numeric loss hook."""

from .gpt import NumericLossGPTModel, loss_func
from .llama import LlamaArchitecture, build_llama

__all__ = ["LlamaArchitecture", "NumericLossGPTModel", "build_llama", "loss_func"]
