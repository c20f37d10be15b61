"""`GPTConfig`: the frozen description of a GPT, and named presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-Experts feed-forward layers (see `eqgpt.nn.MoE`, `docs/parallelism/expert.md`).

    **Fields:**

    - `num_experts`: routed experts per MoE layer.
    - `top_k`: experts each token is sent to (1 = Switch, 2 = Mixtral/GShard).
    - `capacity_factor`: slots per expert and sequence are
      `ceil(capacity_factor * seq * top_k / num_experts)`; assignments past them are
      dropped (the token keeps its residual). Ignored when `dropless`.
    - `dropless`: no capacity; every assignment is computed (grouped matmul).
    - `every`: every n-th layer is an MoE layer (layers n-1, 2n-1, ...), the others dense.
    - `num_shared`: shared experts every token goes through (DeepSeek), as one MLP
      `num_shared` times an expert's width.
    - `expert_dim`: hidden width of one expert (default: the dense `hidden_dim`).
    - `renormalize`: with `top_k > 1`, scale the chosen experts' router probabilities
      to sum to 1 (Mixtral); else use them as they are.
    - `aux_loss_weight`: weight of the Switch/GShard load-balancing loss.
    - `router_z_weight`: weight of the router z-loss `mean(logsumexp(router logits)^2)`.
    """

    num_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    dropless: bool = False
    every: int = 1
    num_shared: int = 0
    expert_dim: int | None = None
    renormalize: bool = True
    aux_loss_weight: float = 0.01
    router_z_weight: float = 0.001

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"GPTConfig.moe.num_experts must be >= 1, got {self.num_experts}.")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"GPTConfig.moe.top_k must be between 1 and num_experts ({self.num_experts}), "
                             f"got {self.top_k}: a token cannot pick more experts than there are.")
        if not self.capacity_factor > 0:
            raise ValueError(f"GPTConfig.moe.capacity_factor must be > 0, got {self.capacity_factor}; "
                             "use e.g. 1.25, or dropless=True for no capacity limit.")
        if self.every < 1 or self.num_shared < 0 or (self.expert_dim is not None and self.expert_dim < 1):
            raise ValueError(
                f"GPTConfig.moe: every >= 1, num_shared >= 0 and expert_dim >= 1 are required, got {self}.")
        if self.aux_loss_weight < 0 or self.router_z_weight < 0:
            raise ValueError(f"GPTConfig.moe loss weights must be >= 0, got {self}.")


@dataclass(frozen=True)
class GPTConfig:
    """Sizes and choices of a GPT. Validated on construction.

    **Fields:**

    - `vocab_size`, `seq_len`: vocabulary size (the tokenizer's) and the longest sequence
      (position table).
    - `vocab_pad_multiple`: the token table and the head get `padded_vocab_size` rows, the
      vocabulary rounded up to this multiple (GPT-2's 50257 -> 50304 at 128), for
      aligned matmuls and tensor-parallel splits. The extra ids never occur: their logits
      are -inf (`GPT.head_logits`), so the loss and sampling never see them.
    - `num_layers`, `num_heads`, `num_kv_heads`, `embed_dim`, `mlp_dim`: shape;
      `num_kv_heads=None` means MHA, `mlp_dim=None` means `4 * embed_dim`.
    - `norm`, `mlp`, `position`: "layernorm"/"rmsnorm", "gelu"/"swiglu", "learned"/"rope".
    - `use_bias`: biases in linear layers and LayerNorms (GPT-2: yes, Llama: no).
    - `tie_embeddings`: reuse the token table as the output head.
    - `attention_kernel`: "auto" (the fastest built-in for the backend and length: flash
      or splash on TPU, cudnn on GPU, reference or blockwise on CPU), "reference", "blockwise",
      "splash", "flash", "cudnn", or a name given to `eqgpt.nn.kernels.register_kernel`.
    - `mask`, `window`: "causal" or "sliding" (with `window` keys).
    - `remat`: gradient checkpointing per block (see `eqgpt.nn.remat`).
    - `moe`: a `MoEConfig` to make the feed-forward layers Mixture-of-Experts; `None`: dense.
    - `scan_layers`: run the layers as one `jax.lax.scan` (compile time independent
      of depth). `False` unrolls them: XLA then keeps each layer's activations as
      separate arrays instead of copying them into and out of `[layers, ...]`
      buffers, which made a 4-layer CPU step 9 % faster; compile time grows with depth.
    - `scan_unroll`: with `scan_layers`, layers per scan iteration (`jax.lax.scan`'s
      `unroll`): 1 compiles one layer; 2-4 trade compile time for step time
      (`benchmarks/compile_time.py --tpu` measures both).
    """

    vocab_size: int = 256
    vocab_pad_multiple: int = 1
    seq_len: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    embed_dim: int = 256
    mlp_dim: int | None = None
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    mlp: Literal["gelu", "swiglu"] = "gelu"
    position: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0
    use_bias: bool = True
    tie_embeddings: bool = True
    attention_kernel: str = "auto"
    mask: Literal["causal", "sliding"] = "causal"
    window: int | None = None
    remat: str = "none"
    scan_layers: bool = True
    scan_unroll: int = 1
    init_std: float = 0.02
    moe: MoEConfig | None = None

    def __post_init__(self):
        if isinstance(self.moe, dict):  # read back from JSON (checkpoint metadata, exports)
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.moe is not None and self.num_layers % self.moe.every:
            raise ValueError(f"GPTConfig.moe.every ({self.moe.every}) must divide num_layers ({self.num_layers}): "
                             "the layers repeat in groups of `every` (the last of each is MoE).")
        for name in ("vocab_size", "vocab_pad_multiple", "seq_len", "num_layers", "num_heads", "embed_dim",
                     "scan_unroll"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}.")
        if self.embed_dim % self.num_heads:
            raise ValueError(
                f"embed_dim ({self.embed_dim}) must be divisible by num_heads ({self.num_heads}); "
                f"pick num_heads from {[d for d in range(1, self.embed_dim + 1) if self.embed_dim % d == 0][:12]}..."
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.kv_heads}) must divide num_heads ({self.num_heads}); "
                f"pick from {[d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]}."
            )
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim; got {self.head_dim}.")
        if self.mask == "sliding" and not self.window:
            raise ValueError('mask="sliding" needs window=N (keys per query).')

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the token table and the head: `vocab_size` rounded up to `vocab_pad_multiple`."""
        return -(-self.vocab_size // self.vocab_pad_multiple) * self.vocab_pad_multiple

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def hidden_dim(self) -> int:
        return 4 * self.embed_dim if self.mlp_dim is None else self.mlp_dim

    def logical_sizes(self) -> dict[str, int]:
        """The size of each logical axis of the model's arrays (`heads`: `num_heads * head_dim`),
        and `seq_len`, its positions: what a mesh must divide (`eqgpt.parallel.check_divisibility`)."""
        return {"embed": self.embed_dim, "heads": self.num_heads * self.head_dim,
                "kv_heads": self.kv_heads * self.head_dim, "mlp": self.hidden_dim, "vocab": self.padded_vocab_size,
                "layers": self.num_layers, "head_dim": self.head_dim, "seq_len": self.seq_len}

    def architecture(self) -> dict:
        """The fields that fix the parameters and the function they compute: every field but
        how the layers run (`attention_kernel`, `remat`, `scan_layers`, `scan_unroll`), which a run may
        change when it resumes from a checkpoint; `vocab_pad_multiple` only when it pads."""
        how = {"attention_kernel", "remat", "scan_layers", "scan_unroll"}
        if self.vocab_pad_multiple == 1:  # unpadded: as checkpoints written before the field, resumable
            how.add("vocab_pad_multiple")
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in how}

    def replace(self, **changes) -> GPTConfig:
        """A copy with `changes` applied (and validated)."""
        return dataclasses.replace(self, **changes)


_GPT2 = dict(vocab_size=50257, vocab_pad_multiple=128, seq_len=1024, norm="layernorm", mlp="gelu",
             position="learned", use_bias=True, tie_embeddings=True)
_LLAMA = dict(norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", position="rope", use_bias=False,
              tie_embeddings=False)

PRESETS: dict[str, GPTConfig] = {
    # CPU-sized byte-level models: the default recipe and the tests.
    "nano": GPTConfig(vocab_size=256, seq_len=128, num_layers=4, num_heads=4, embed_dim=128),
    "llama-nano": GPTConfig(vocab_size=256, seq_len=256, num_layers=4, num_heads=4,
                            num_kv_heads=2, embed_dim=256, mlp_dim=688, **_LLAMA),
    # Mixture-of-Experts nano: 8 experts of half nano's MLP width, top-2: the same
    # active parameters per token as nano (2 x 256 = its 512-wide MLP, plus a router),
    # 4x its feed-forward parameters in all. Trains on the default corpus on CPU.
    "moe-nano": GPTConfig(vocab_size=256, seq_len=128, num_layers=4, num_heads=4, embed_dim=128,
                          moe=MoEConfig(num_experts=8, top_k=2, expert_dim=256)),
    # GPT-2 (Radford et al. 2019), with its 50257-token vocabulary (in 50304 rows, as nanoGPT).
    "gpt2-small": GPTConfig(num_layers=12, num_heads=12, embed_dim=768, **_GPT2),
    "gpt2-medium": GPTConfig(num_layers=24, num_heads=16, embed_dim=1024, **_GPT2),
    "gpt2-large": GPTConfig(num_layers=36, num_heads=20, embed_dim=1280, **_GPT2),
    "gpt2-xl": GPTConfig(num_layers=48, num_heads=25, embed_dim=1600, **_GPT2),
    # gpt2-small with 8 dropless experts of half its MLP width, top-2: the same active parameters.
    "gpt2-small-moe": GPTConfig(num_layers=12, num_heads=12, embed_dim=768,
                                moe=MoEConfig(num_experts=8, top_k=2, expert_dim=1536, dropless=True), **_GPT2),
    # Llama-style: RoPE, RMSNorm, SwiGLU, GQA (shape of a ~1B model).
    "llama-1b": GPTConfig(vocab_size=32000, seq_len=2048, num_layers=16, num_heads=32,
                          num_kv_heads=8, embed_dim=2048, mlp_dim=5632, rope_theta=500000.0, **_LLAMA),
    # Llama 3 shapes (Grattafiori et al. 2024, "The Llama 3 Herd of Models", table 3), for planning
    # (eqgpt-plan): 128,256-token vocabulary, 8192 positions, GQA with 8 key/value heads.
    "llama-8b": GPTConfig(vocab_size=128256, seq_len=8192, num_layers=32, num_heads=32, num_kv_heads=8,
                          embed_dim=4096, mlp_dim=14336, rope_theta=500000.0, **{**_LLAMA, "norm_eps": 1e-5}),
    "llama-70b": GPTConfig(vocab_size=128256, seq_len=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                           embed_dim=8192, mlp_dim=28672, rope_theta=500000.0, **{**_LLAMA, "norm_eps": 1e-5}),
    # Mixtral 8x7B's shape (Jiang et al. 2024): 8 SwiGLU experts, top-2, every layer.
    "mixtral-8x7b": GPTConfig(vocab_size=32000, seq_len=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                              embed_dim=4096, mlp_dim=14336, rope_theta=1e6,
                              moe=MoEConfig(num_experts=8, top_k=2, dropless=True, aux_loss_weight=0.02),
                              **{**_LLAMA, "norm_eps": 1e-5}),
    # DeepSeek-MoE style (Dai et al. 2024): fine-grained experts (64 of 1/4 width, top-6)
    # plus 2 shared experts, at ~2B total parameters.
    "deepseek-moe-2b": GPTConfig(vocab_size=32000, seq_len=2048, num_layers=16, num_heads=16, embed_dim=1536,
                                 mlp_dim=4096, moe=MoEConfig(num_experts=64, top_k=6, num_shared=2,
                                                             expert_dim=1024, capacity_factor=1.5), **_LLAMA),
}


def preset(name: str, **overrides) -> GPTConfig:
    """The named preset, with optional field overrides."""
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]


# Layers unrolled by default up to these depths (the recipe, the benchmarks); deeper stacks scan, as an
# unrolled stack's compile time grows with depth. Unrolled steps are faster: 9-14% on CPU at 4 layers;
# on a TPU v5e gpt2-small took 155.1 ms unrolled and 180.7 ms scanned (docs/profiling_results.md).
UNROLL_MAX_LAYERS = {"cpu": 8, "gpu": 12, "tpu": 12}


def scans_by_default(num_layers: int, platform: str) -> bool:
    """Whether a model this deep scans its layers on `platform` ("cpu", "tpu", "gpu") by default."""
    return num_layers > UNROLL_MAX_LAYERS.get(platform, UNROLL_MAX_LAYERS["cpu"])
