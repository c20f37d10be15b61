"""Train a GPT from scratch, watch it learn, sample from it.

Default: the `nano` preset on the Python standard library's own sources, on CPU,
in about ten minutes. Every option is a dataclass field below; see `--help`.

    .venv/bin/python recipes/train_gpt.py
    .venv/bin/python recipes/train_gpt.py --steps 50 --data.corpus 'notes/**/*.md'
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import jax
import tyro

import eqgpt
from eqgpt import distributed
from eqgpt.data import BatchLoader, ByteTokenizer, eval_windows, load_corpus
from eqgpt.nn import GPT
from eqgpt.profile.flops import flops_per_token, peak_flops
from eqgpt.sample import generate_text
from eqgpt.train import (
    Policy,
    SingleDevice,
    Trainer,
    TrainerConfig,
    TrainState,
    make_eval_fn,
    make_optimizer,
    make_schedule,
    make_train_step,
    plot_history,
    save_model,
)
from eqgpt.train.checkpoint import Checkpointer
from eqgpt.train.preemption import PREEMPTED_EXIT_CODE


@dataclass
class DataConfig:
    """Where the text comes from."""

    corpus: str = "stdlib"
    """'stdlib' (this Python's standard library .py files), a directory, a glob such as 'docs/**/*.md', or a .bin (uint16) / .npy token file."""
    cache_dir: Path | None = None
    """Token cache directory (default: $EQGPT_CACHE or ~/.cache/eqgpt)."""
    val_percent: float = 5.0
    """Share held out for validation: of files (text) or of the token tail (token files)."""


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
    position: Literal["learned", "rope"] | None = None
    """Override: learned or rotary position embeddings."""

    def build(self) -> eqgpt.GPTConfig:
        names = ("seq_len", "num_layers", "num_heads", "embed_dim", "position")
        overrides = {k: getattr(self, k) for k in names if getattr(self, k) is not None}
        return eqgpt.preset(self.preset, **overrides)


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


@dataclass
class TrainConfig:
    """Train a GPT and write config, metrics, loss plot, samples and the model to out_dir."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    # --- parallelism (eqgpt.parallel): these fields and `make_placement` are the only
    # places that know about devices.
    mesh: str = ""
    """Device mesh, e.g. 'data=2,fsdp=2,tensor=2' (axes data, fsdp, pipeline, context, tensor; -1 fills); '' = one device."""
    strategy: str = "dp"
    """Sharding rules on --mesh: presets dp, fsdp, tp, sp joined by '+' (e.g. 'fsdp+tp'); sp implies tp."""
    report: bool = False
    """Print the compiled step's collectives and per-device memory (eqgpt.profile.report) before training."""
    cpu_devices: int | None = None
    """Simulate this many CPU devices (set before JAX starts), e.g. 8 to try --mesh on one machine."""
    manual: bool = False
    """Manual path (eqgpt.parallel.data.manual_grad_fn): the step runs in shard_map with explicit collectives; --mesh data/tensor axes only, --strategy containing 'sp' adds sequence parallelism."""
    context_attention: Literal["off", "ring", "allgather"] = "off"
    """Split the sequence over the --mesh 'context' axis (zigzag order) with ring or all-gather attention; seq_len must be a multiple of 2 * context."""
    # --- end parallelism
    # --- checkpoints and multi-process runs (eqgpt.train.checkpoint, eqgpt.distributed)
    checkpoint_every: int = 0
    """Steps between checkpoints (0: none). With checkpoints (or --resume) a run also saves at the end and on SIGTERM/SIGINT. A stopped run exits with status 75 (SIGTERM: at once; Ctrl-C: after its samples and plots)."""
    checkpoint_dir: Path | None = None
    """Checkpoint directory (default: out_dir/checkpoints)."""
    checkpoint_keep: int = 3
    """Newest checkpoints to keep."""
    resume: bool = False
    """Continue from the latest good checkpoint in checkpoint_dir, on any --mesh (start at step 0 if there is none)."""
    # --- end checkpoints and multi-process runs
    steps: int = 800
    """Optimizer steps."""
    batch_size: int = 32
    """Sequences per step (global)."""
    accum_steps: int = 1
    """Microbatches per step (gradient accumulation); must divide batch_size."""
    seed: int = 0
    """Seed of the initialisation and of every batch (a batch is a function of seed and step)."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute dtype: auto = fp32 on CPU, bf16 on GPU/TPU."""
    out_dir: Path = Path("runs/nano")
    """Output directory (config.json, metrics.jsonl, loss.png, samples.txt, model)."""
    log_every: int = 10
    """Steps between loss read-backs and metric lines."""
    eval_every: int = 100
    """Steps between validation losses."""
    eval_windows: int = 64
    """Validation windows (fixed, spread over the held-out files)."""
    peak_flops: float | None = None
    """Peak FLOP/s for the MFU estimate (default: GPU table, or a measured matmul on CPU)."""
    sample_prompts: tuple[str, ...] = ("def ", "class ", "import ")
    """Prompts of the samples generated at the end."""
    sample_tokens: int = 100
    """New tokens per sample."""
    progress: bool = True
    """Show a progress bar."""


def make_placement(cfg: TrainConfig, model_cfg: eqgpt.GPTConfig | None = None):
    """Where the model and the batches live: one device, or a mesh split by `--strategy` rules."""
    if not cfg.mesh:
        if cfg.manual:
            raise ValueError("--manual needs a --mesh, e.g. --mesh data=2,tensor=4.")
        if cfg.context_attention != "off":
            raise ValueError("--context-attention needs a --mesh with a context axis, e.g. --mesh context=4,data=2.")
        return SingleDevice()
    from eqgpt import parallel as par

    mesh = par.make_mesh(cfg.mesh)
    if cfg.manual and cfg.context_attention != "off":
        raise ValueError("--context-attention runs on the automatic path; drop --manual.")
    if cfg.manual:  # manual path: layout of eqgpt.parallel.data.manual_specs
        from eqgpt.parallel.data import manual_placement

        return manual_placement(mesh, model_cfg or cfg.model.build())

    rules = cfg.strategy
    if cfg.context_attention != "off":
        from eqgpt.parallel import context as cp

        rules = cp.context_rules(cfg.strategy)
        cp.check_layout((model_cfg or cfg.model.build()).seq_len, mesh.shape["context"], "zigzag")
    placement = par.ShardedPlacement(mesh, rules)
    if model_cfg is not None:  # sizes the mesh cannot split fail here, before anything compiles
        par.check_divisibility(model_cfg, placement.mesh, placement.rules,
                               cfg.batch_size // cfg.accum_steps, model_cfg.seq_len)
    return placement


def main(cfg: TrainConfig) -> dict:
    """Run the recipe; **returns** a summary (`val_loss`, `steps`, `seconds`, `samples`)."""
    t0 = time.perf_counter()
    if cfg.cpu_devices:  # must precede the first use of a JAX backend
        jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
    distributed.initialize()  # one process: nothing; several: EQGPT_* / SLURM / Open MPI settings
    is_main = jax.process_index() == 0  # only process 0 prints and writes files
    model_cfg = cfg.model.build()
    if cfg.batch_size % cfg.accum_steps:
        raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by accum_steps ({cfg.accum_steps}).")
    corpus = load_corpus(cfg.data.corpus, cache_dir=cfg.data.cache_dir, val_percent=cfg.data.val_percent,
                         min_tokens=model_cfg.seq_len + 1, vocab_size=model_cfg.vocab_size)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if is_main:
        if not cfg.resume:
            (out / "metrics.jsonl").unlink(missing_ok=True)
        (out / "config.json").write_text(json.dumps(
            {"recipe": dataclasses.asdict(cfg), "model": dataclasses.asdict(model_cfg)}, indent=2, default=str))

    placement = make_placement(cfg, model_cfg)
    policy = Policy.default() if cfg.precision == "auto" else Policy.named(cfg.precision)
    schedule = make_schedule(cfg.optim.lr, total_steps=cfg.steps, warmup_steps=min(cfg.optim.warmup_steps, cfg.steps - 1),
                             min_lr_ratio=cfg.optim.min_lr_ratio)
    optimizer = make_optimizer(
        schedule, weight_decay=cfg.optim.weight_decay, b1=cfg.optim.b1, b2=cfg.optim.b2,
        clip_norm=cfg.optim.clip_norm or None, decay_embeddings=cfg.optim.decay_embeddings,
        decay_norms_and_biases=cfg.optim.decay_norms_and_biases,
    )
    key_model, key_state = jax.random.split(jax.random.key(cfg.seed))
    make_model = lambda k: GPT(model_cfg, key=k)  # noqa: E731
    if cfg.context_attention != "off":  # context parallelism: ring / all-gather kernels
        from eqgpt.parallel import context as cp

        block = min(128, model_cfg.seq_len // (2 * placement.mesh.shape["context"]))
        make_model = lambda k: cp.use_context_attention(  # noqa: E731
            GPT(model_cfg, key=k), placement.mesh, cfg.context_attention, block_q=block, block_k=block)
    model = placement.init_model(make_model, key_model)
    state = TrainState(model, placement.init_opt_state(optimizer, model), rng=key_state)
    # --- checkpoints and multi-process runs
    if jax.process_count() > 1:  # every process must hold what process 0 holds, or stop now
        mesh = distributed.mesh_fields(placement.mesh) if hasattr(placement, "mesh") else "single"
        distributed.check_same_on_all_processes({"recipe": dataclasses.asdict(cfg), "model": model_cfg, "mesh": mesh})
        distributed.check_replicas_agree(state.model)
    checkpointer = None
    if cfg.checkpoint_every or cfg.resume:
        checkpointer = Checkpointer(
            cfg.checkpoint_dir or out / "checkpoints", every=cfg.checkpoint_every or cfg.steps,
            keep=cfg.checkpoint_keep, must_match=("model", "data_order"),
            config={"model": model_cfg, "data_order": {"seed": cfg.seed}, "recipe": dataclasses.asdict(cfg)},
        )
        restored = checkpointer.restore(state) if cfg.resume else None
        if restored is not None:  # the shardings are this run's (any mesh); batches resume at its step
            state = restored.state
            if is_main:
                print(f"resumed from checkpoint {restored.step} in {checkpointer.directory}", flush=True)
        elif cfg.resume and is_main:
            print(f"--resume: no checkpoint in {checkpointer.directory}; starting at step 0", flush=True)
    # --- end checkpoints and multi-process runs
    grad_fn = None
    if cfg.manual:  # manual path: explicit collectives under shard_map
        from eqgpt.parallel.data import manual_grad_fn

        grad_fn = manual_grad_fn(model, placement.mesh, compute_dtype=policy.compute_dtype,
                                 sequence_parallel="sp" in cfg.strategy.split("+"))
    eval_fn = make_eval_fn(policy=policy)
    if cfg.context_attention != "off":  # context parallelism: zigzag batches, sharded loss
        grad_fn = cp.context_grad_fn(placement.mesh, policy=policy)
        eval_fn = make_eval_fn(cp.context_loss_fn(placement.mesh), policy=policy)
    step_fn = make_train_step(optimizer, grad_fn=grad_fn, accum_steps=cfg.accum_steps, policy=policy)
    loader = BatchLoader(corpus.train, batch_size=cfg.batch_size, seq_len=model_cfg.seq_len, seed=cfg.seed)
    val = eval_windows(corpus.val, seq_len=model_cfg.seq_len, num_windows=cfg.eval_windows)
    if cfg.report:  # the compiled step as evidence: collectives and memory per device
        from eqgpt.profile import report

        compiled = step_fn.lower(state, placement.batch(loader.local_batch(0))).compile()
        print(report(compiled, mesh=getattr(placement, "mesh", None), title=f"{cfg.strategy if cfg.mesh else 'single'}"))

    peak, peak_source = (cfg.peak_flops, "--peak-flops") if cfg.peak_flops else peak_flops()
    n_params = sum(x.size for x in jax.tree.leaves(model) if hasattr(x, "size"))
    if is_main:
        print(f"model {cfg.model.preset}: {n_params / 1e6:.2f}M params, {model_cfg.num_layers} layers x "
              f"{model_cfg.embed_dim} wide, seq {model_cfg.seq_len} | corpus {corpus.name}: "
              f"{len(corpus.train) / 1e6:.1f}M train / {len(corpus.val) / 1e6:.2f}M val tokens | "
              f"{placement} | peak {peak / 1e9:.0f} GFLOP/s ({peak_source})", flush=True)

    trainer = Trainer(
        step_fn, state, loader, placement, val_windows=val, schedule=schedule,
        config=TrainerConfig(steps=cfg.steps, log_every=cfg.log_every, eval_every=cfg.eval_every,
                             out_dir=out, progress=cfg.progress),
        flops_per_token=flops_per_token(model_cfg), peak_flops=peak, eval_fn=eval_fn,
        checkpointer=checkpointer,
    )
    state = trainer.run()
    if trainer.stop_signal == signal.SIGTERM:  # preempted: the checkpoint is written; leave within the grace period
        summary = {"steps": int(state.step), "interrupted": True, "seconds": time.perf_counter() - t0}
        if is_main:
            (out / "summary.json").write_text(json.dumps(summary, indent=2))
            print(f"stopped at step {summary['steps']} by signal {trainer.stop_signal}; rerun with --resume "
                  f"to continue (exit status {PREEMPTED_EXIT_CODE})", flush=True)
        return summary
    saved = state.model
    if cfg.context_attention != "off":  # context parallelism: save the plain GPT
        saved = cp.strip_context_attention(saved)
    save_model(out, saved)
    if is_main:
        plot_history(trainer.history, out / "loss.png", title=f"{cfg.model.preset} on {corpus.name}")

    tok = ByteTokenizer()
    samples = []
    n_new = min(cfg.sample_tokens, model_cfg.seq_len - max(len(tok.encode(p)) for p in cfg.sample_prompts))
    for i, prompt in enumerate(cfg.sample_prompts):
        if n_new < 1:
            break
        text = generate_text(state.model, tok, prompt, n_new, key=jax.random.fold_in(state.rng, i))[0]
        samples.append(text)
    if is_main:
        (out / "samples.txt").write_text("".join(f"--- sample {i} ---\n{s}\n" for i, s in enumerate(samples)))
        for i, s in enumerate(samples):
            print(f"--- sample {i} ---\n{s}")
    _, vals = trainer.history.series("val_loss")
    summary = {"val_loss": vals[-1] if vals else None, "first_val_loss": vals[0] if vals else None,
               "steps": int(state.step), "skipped": int(state.skipped), "interrupted": trainer.interrupted,
               "seconds": time.perf_counter() - t0, "samples": samples}
    if not is_main:
        return summary
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"done: val loss {summary['first_val_loss']:.3f} -> {summary['val_loss']:.3f} nats/byte "
          f"in {summary['seconds'] / 60:.1f} min; outputs in {out}/")
    return summary


if __name__ == "__main__":
    summary = main(tyro.cli(TrainConfig))
    sys.exit(PREEMPTED_EXIT_CODE if summary["interrupted"] else 0)
