"""Typed Equinox modules for GPT models. Nothing here knows about devices."""

from eqgpt.nn.attention import Attention, KVCache
from eqgpt.nn.axes import REGION_INPUT, ActivationHook, LogicalAxes, NoConstraint, logical_axes, map_constraints
from eqgpt.nn.block import Block
from eqgpt.nn.embedding import Embedding
from eqgpt.nn.factory import get_block, register_block
from eqgpt.nn.gpt import GPT, make_block
from eqgpt.nn.linear import Linear
from eqgpt.nn.loss import chunked_cross_entropy, chunked_loss_sums, head_loss_sums, lm_loss
from eqgpt.nn.mask import CausalMask, DocumentMask, FullMask, Mask, SlidingWindowMask, make_mask
from eqgpt.nn.mlp import MLP, SwiGLU
from eqgpt.nn.moe import Experts, MoE, MoEStats, moe_loss
from eqgpt.nn.norm import LayerNorm, RMSNorm
from eqgpt.nn.protocol import LanguageModel
from eqgpt.nn.rope import apply_rope

__all__ = [
    "GPT", "LanguageModel", "Attention", "KVCache", "Block", "Embedding", "Linear", "MLP", "SwiGLU",
    "MoE", "Experts", "MoEStats", "moe_loss",
    "LayerNorm", "RMSNorm", "Mask", "CausalMask", "DocumentMask", "FullMask",
    "SlidingWindowMask", "make_mask", "apply_rope", "make_block", "lm_loss",
    "chunked_cross_entropy", "chunked_loss_sums", "head_loss_sums", "logical_axes", "map_constraints", "LogicalAxes",
    "ActivationHook",
    "NoConstraint",
    "REGION_INPUT", "register_block", "get_block",
]
