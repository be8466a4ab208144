"""Plain nn.Module models that know nothing about parallelism (see transformer.CausalLM)."""

from model_zoo.config import GDNConfig, ModelConfig, MoEConfig
from model_zoo.counting import ParamCount, count_parameters, flops_per_token
from model_zoo.moe import MoE
from model_zoo.registry import MODEL_NAMES, get_model_config
from model_zoo.transformer import Block, CausalLM, build_model

__all__ = [
    "MODEL_NAMES",
    "Block",
    "CausalLM",
    "GDNConfig",
    "MoE",
    "MoEConfig",
    "ModelConfig",
    "ParamCount",
    "build_model",
    "count_parameters",
    "flops_per_token",
    "get_model_config",
]
