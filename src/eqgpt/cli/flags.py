"""The recipe's data, model and optimizer flags (`--data.*`, `--model.*`, `--optim.*`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import eqgpt
from eqgpt.config import scans_by_default
from eqgpt.nn.factory import get_block
from eqgpt.nn.kernels import get_kernel
from eqgpt.nn.kernels.platform import target_platform


@dataclass
class DataConfig:
    """Where the text comes from."""

    corpus: str = "stdlib"
    ("'stdlib' (this Python's standard library .py files), a directory (hidden and binary files skipped), a glob such "
     "as 'docs/**/*.md', one text file (its tail validates), a nanoGPT data folder (train.bin, val.bin, meta.pkl), or "
     "a .bin (uint16) / .npy token file.")
    cache_dir: Path | None = None
    """Token cache directory (default: $EQGPT_CACHE or ~/.cache/eqgpt)."""
    val_percent: float = 5.0
    """Share held out for validation: of files (text) or of the token tail (token files)."""
    mode: Literal["windows", "packed"] = "windows"
    ("'windows': random windows across documents (as always); 'packed': whole documents packed into rows, with "
     "segment ids and positions restarting per document (see docs/data.md).")
    threads: int = 2
    """Grain background threads building batches (0: load in the training thread)."""
    prefetch: int = 4
    """Batches built ahead of the step."""
    tokenizer: str = "bytes"
    ("'bytes' (default), 'bpe:N' (byte-level BPE of N tokens trained on the training split, cached with the tokens), "
     "a tokenizer.json, or a GPT-2 vocab.json (merges.txt beside it). A non-byte tokenizer sets the model's "
     "vocab_size.")


@dataclass
class ModelConfig:
    """The model: a preset from `eqgpt.PRESETS`, with optional overrides."""

    preset: str = "nano"
    """Preset name: nano, llama-nano, gpt2-small, ... (see eqgpt/config.py)."""
    seq_len: int | None = None
    """Override: sequence length (positions)."""
    num_layers: int | None = None
    """Override: number of transformer blocks."""
    num_heads: int | None = None
    """Override: attention heads."""
    embed_dim: int | None = None
    """Override: model width."""
    num_kv_heads: int | None = None
    """Override: key/value heads (grouped-query attention; must divide --model.num-heads)."""
    mlp_dim: int | None = None
    """Override: hidden width of the MLP (default: 4 x --model.embed-dim)."""
    norm: Literal["layernorm", "rmsnorm"] | None = None
    """Override: LayerNorm or RMSNorm."""
    mlp: Literal["gelu", "swiglu"] | None = None
    """Override: GELU MLP or SwiGLU."""
    position: Literal["learned", "rope"] | None = None
    """Override: learned or rotary position embeddings."""
    window: int | None = None
    """Override: sliding-window attention over this many keys per query (default: causal over all)."""
    block: str | None = None
    ("Block factory building each layer: a name registered with eqgpt.nn.register_block, or MODULE:NAME (default: "
     "eqgpt's own block). Recorded in model_config.json for eqgpt-sample.")
    scan_layers: bool = False
    ("Run the layers as one lax.scan (compile time independent of depth). By default models of up to 8 layers (12 on "
     "an accelerator) unroll them, for faster steps; deeper ones scan, as an unrolled stack's compile time grows with "
     "depth (eqgpt.config.scans_by_default).")
    num_experts: int | None = None
    """Override: MoE experts per layer (an MoE preset such as moe-nano; on a dense preset, makes it MoE)."""
    top_k: int | None = None
    """Override: experts per token."""
    capacity_factor: float | None = None
    """Override: expert slots per sequence = ceil(capacity_factor * seq * top_k / experts); the rest drop."""
    dropless: bool | None = None
    """Override: compute every routed token (grouped matmul; no capacity, nothing drops)."""
    attention_kernel: str | None = None
    ("Override: attention kernel: auto (default: flash or splash on TPU, cudnn on GPU, reference or "
     "blockwise on CPU, by length), reference, blockwise, splash, flash, cudnn, or a registered name.")
    remat: str | None = None
    ("Override: gradient checkpointing per layer: none, full, minimal (save every matmul output), "
     "save_dot_except_mlp, save_qkv_proj, save_out_proj, names:..., offload:... (eqgpt.nn.remat).")
    vocab_size: int | None = None
    ("Override: vocabulary size. Default: the tokenizer's for text; for a .bin/.npy token file, its NAME.meta.json "
     "{\"vocab_size\": N}, else the file's max id + 1 rounded up to a multiple of 64.")

    def build(self) -> eqgpt.GPTConfig:
        """The preset with the overrides given; errors name the flags."""
        names = ("seq_len", "num_layers", "num_heads", "num_kv_heads", "embed_dim", "mlp_dim", "norm", "mlp",
                 "position", "window", "vocab_size", "attention_kernel", "remat")
        overrides = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        moe = {k: getattr(self, k) for k in ("num_experts", "top_k", "capacity_factor", "dropless")
               if getattr(self, k) is not None}
        given = "".join(f" --model.{k.replace('_', '-')} {v}" for k, v in {**overrides, **moe}.items())
        if self.window is not None:
            overrides["mask"] = "sliding"
        try:
            base = eqgpt.preset(self.preset)
        except ValueError as e:
            raise ValueError(f"--model.preset {self.preset}: {e}") from None
        try:
            if moe:
                overrides["moe"] = dataclasses.replace(base.moe or eqgpt.MoEConfig(), **moe)
            layers = overrides.get("num_layers", base.num_layers)
            scan = self.scan_layers or scans_by_default(layers, target_platform())
            return base.replace(scan_layers=scan, **overrides)
        except ValueError as e:  # name the flags the user gave
            raise ValueError(f"{e} (from --model.preset {self.preset}{given})") from None

    def block_factory(self):
        """The factory of --model.block (default: eqgpt's own block); errors name the flag."""
        try:
            return get_block(self.block)
        except ValueError as e:
            raise ValueError(f"--model.block {self.block}: {e}") from None

    def check_kernel(self, config: eqgpt.GPTConfig) -> None:
        """Refuse an attention kernel that is neither built in nor registered (by --import)."""
        try:
            get_kernel(config.attention_kernel)
        except ValueError as e:
            raise ValueError(f"--model.attention-kernel {config.attention_kernel}: {e} A package of yours: "
                             "--import MODULE.") from None


@dataclass
class OptimConfig:
    """AdamW with linear warmup and cosine decay, global-norm clipping."""

    lr: float = 3e-3
    """Peak learning rate."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to lr."""
    min_lr_ratio: float = 0.02
    """Final learning rate as a fraction of lr (cosine decay end)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices only unless the flags below)."""
    b1: float = 0.9
    """Adam first-moment decay."""
    b2: float = 0.99
    """Adam second-moment decay."""
    clip_norm: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    decay_embeddings: bool = False
    """Also apply weight decay to embedding tables."""
    decay_norms_and_biases: bool = False
    """Also apply weight decay to norm scales and biases."""
    mu_dtype: Literal["fp32", "bf16"] | None = None
    """AdamW's first moment in this dtype (bf16 halves it; default: the parameters' dtype)."""
    extend: Literal["cosine", "linear", "constant", "restart"] = "cosine"
    ("How --resume --steps N past the run's schedule continues the learning rate, from its rate at the resume "
     "step (no jump): cosine down to the final rate (lr x min_lr_ratio) at step N, linear down to it, constant; "
     "or restart (a new warmup and cosine over all N steps: the rate jumps).")
