"""`eqgpt-train`: train a GPT from scratch, watch it learn, sample from it.

Default: the `nano` preset on the Python standard library's own sources, on CPU.
Every option is a dataclass field below (`eqgpt.cli.flags` for --model, --data,
--optim; `eqgpt.parallel.ParallelFlags` for the parallel ones); see `--help`.

    eqgpt-train
    eqgpt-train --steps 50 --data.corpus 'notes/**/*.md'
    # your kernel and block (docs/extending.md):
    eqgpt-train --import mypkg --model.attention-kernel mine --model.block narrow

`recipes/train_gpt.py` runs the same.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
import typing
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

import jax
import tyro

import eqgpt
from eqgpt import distributed
from eqgpt.cli import exit_on_user_error, imports_in, parse_cli
from eqgpt.cli.checks import check_run_flags, flag_name
from eqgpt.cli.flags import DataConfig, ModelConfig, OptimConfig
from eqgpt.compile_cache import enable_compile_cache
from eqgpt.data import ByteTokenizer, bytes_per_token, eval_windows, load_corpus
from eqgpt.data.batch import Batch
from eqgpt.data.grain_source import LoaderConfig, make_loader
from eqgpt.launch import restart_with_malloc_tunables
from eqgpt.nn import GPT
from eqgpt.nn.factory import factory_path, import_modules
from eqgpt.parallel import ParallelFlags
from eqgpt.profile import print_evidence
from eqgpt.profile.compiles import CompileLog
from eqgpt.profile.flops import flops_per_token, peak_flops
from eqgpt.train import (
    Policy,
    Strategy,
    Trainer,
    TrainerConfig,
    make_eval_fn,
    make_optimizer,
    make_train_step,
)
from eqgpt.train.ahead import compile_ahead
from eqgpt.train.checkpoint import Checkpointer
from eqgpt.train.finish import finish, sample_inputs
from eqgpt.train.fit import check_memory, fit_batch, kernel_name
from eqgpt.train.preemption import PREEMPTED_EXIT_CODE, Stopped, StopSignal, at_forced_exit, forced_exit
from eqgpt.train.resume import check_resume, corpora_trained, corpus_record, newest_checkpoint, restore_run
from eqgpt.train.run_dir import (
    earlier_rows,
    finished,
    leave_run,
    new_run_dir,
    point_latest,
    run_to_continue,
    under_root,
)
from eqgpt.train.schedule_plan import planned_schedule, schedule_plan
from eqgpt.train.state import initial_state


@dataclass
class TrainConfig:
    """Train a GPT; write its config, metrics, loss plot, samples and model to --out-dir.

    Common flags: --steps N, --batch-size N, --optim.lr LR, --data.corpus PATH, --model.preset NAME, --out-dir DIR.

    A package of yours (kernels, blocks, presets): --import MODULE. Parallel flags come last.

    Example: eqgpt-train --steps 200 --batch-size 16 --optim.lr 1e-3 --data.corpus input.txt --out-dir runs/mine
    """

    steps: int = 800
    """Optimizer steps."""
    batch_size: int | Literal["auto"] = 32
    """Sequences per step (global); 'auto': the largest that fits the device's memory (from a few compiles)."""
    out_dir: Path | None = None
    ("Output directory (config.json, metrics.jsonl, loss.png, samples.txt, model, checkpoints); one that holds "
     "another run is refused without --resume. Default: a fresh runs/PRESET-YYYYmmdd-HHMMSS, which runs/latest points "
     "at once it trains; with --resume, the run runs/latest points at.")
    imports: Annotated[tuple[str, ...], tyro.conf.arg(name="import"), tyro.conf.UseAppendAction] = ()
    ("Import this module before the flags are resolved (repeatable): a package of yours that registers attention "
     "kernels (eqgpt.nn.kernels.register_kernel), blocks (eqgpt.nn.register_block) or presets (eqgpt.PRESETS).")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: Annotated[ParallelFlags, tyro.conf.OmitArgPrefixes] = field(default_factory=ParallelFlags)
    """How the run is distributed: --mesh, --strategy and each parallelism's flags (eqgpt.parallel.ParallelFlags)."""
    report: bool = False
    """Print the compiled step's collectives and per-device memory (eqgpt.profile.report) before training."""
    estimate: bool = False
    ("Print the predicted per-device memory (eqgpt.profile.estimate, before compiling), then next to the compiled "
     "step's.")
    cpu_devices: int | None = None
    """Simulate this many CPU devices (set before JAX starts), e.g. 8 to try --mesh on one machine."""
    compile_cache: bool = True
    ("Keep every compiled program in JAX's persistent compilation cache: a second start with the same model, mesh and "
     "flags reads them instead of compiling (docs/profiling.md). Off: --no-compile-cache, or EQGPT_NO_COMPILE_CACHE=1 "
     "(the test suite); a JAX_COMPILATION_CACHE_DIR already set wins.")
    compile_cache_dir: Path | None = None
    ("Directory of the compilation cache (default: $EQGPT_CACHE/xla, else ~/.cache/eqgpt/xla); at most 4 GiB, least "
     "recently used entries evicted.")
    # --- checkpoints and multi-process runs (eqgpt.train.checkpoint, eqgpt.distributed)
    checkpoint_every: int = 0
    ("Steps between checkpoints (0: none between). Every run also saves one at the end and on SIGTERM/SIGINT, for "
     "--resume. A stopped run exits with status 75 (SIGTERM: at once; Ctrl-C: after its samples and plots).")
    checkpoint_dir: Path | None = None
    """Checkpoint directory (default: out_dir/checkpoints)."""
    checkpoint_keep: int = 3
    """Newest checkpoints to keep."""
    resume: bool = False
    ("Continue the run in --out-dir (default: the one runs/latest points at) from its latest good checkpoint, on any "
     "--mesh and strategy; flags left out take that run's values. A finished run is left unchanged unless --steps "
     "asks for more. Starts at step 0 if the directory holds no checkpoint (see --allow-fresh). A damaged newest "
     "checkpoint is named in a warning and the next older one is used.")
    # --- faults (docs/checkpointing.md#faults): exit 76 (non-finite) / 77 (diverged) after saving the last good state
    strict: bool = False
    """With --resume: refuse (exit 1) when the newest checkpoint is damaged, instead of falling back to an older one."""
    allow_fresh: bool = False
    ("With --resume: start at step 0 even when the checkpoint directory holds traces of earlier checkpoints "
     "(interrupted writes, damaged steps) but none complete; without it the run refuses.")
    allow_new_corpus: bool = False
    ("With --resume: continue on a --data.corpus whose tokens differ from those the run trained on (by default "
     "refused); the switch and its step are recorded in config.json's 'corpora'.")
    max_skipped: int = 0
    """Stop (exit 76) after this many skipped updates in a row (non-finite loss or gradients); 0: never."""
    divergence_factor: float = 0.0
    ("Stop (exit 77) when --divergence-window losses in a row exceed this factor times the running mean of the loss; "
     "0: never.")
    divergence_window: int = 3
    """Divergent losses in a row that stop the run (K)."""
    # --- the run
    accum_steps: int = 1
    """Microbatches per step (gradient accumulation); must divide batch_size."""
    seed: int = 0
    """Seed of the initialisation and of every batch (a batch is a function of seed and step)."""
    precision: Literal["auto", "fp32", "bf16", "fp16", "int8"] = "auto"
    ("Compute dtype: auto = fp32 on CPU, bf16 on GPU/TPU; fp16 adds dynamic loss scaling; int8: bf16 with the "
     "projection and MLP matmuls through int8 (docs/numerics.md#int8-matmuls).")
    int8_backward: Literal["qat", "qt"] = "qat"
    ("With --precision int8, the backward's matmuls: qat = straight-through, in bf16 on the dequantized operands; "
     "qt = through int8 too.")
    master_weights: bool = False
    """Store the parameters in the compute dtype (bf16/fp16) with fp32 master weights in the optimizer state."""
    z_loss: float = 0.0
    """Weight of the z-loss (mean squared log-partition), 0 to disable."""
    log_every: int = 10
    """Steps between loss read-backs and metric lines."""
    eval_every: int = 100
    """Steps between validation losses."""
    eval_windows: int = 64
    """Validation windows (fixed, spread over the held-out files); any number works on any mesh; 0: no validation."""
    peak_flops: float | None = None
    """Peak FLOP/s for the MFU estimate (default: GPU table, or a measured matmul on CPU)."""
    sample_prompts: tuple[str, ...] = ("def ", "class ", "import ")
    """Prompts of the samples generated at the end."""
    sample_tokens: int = 100
    """New tokens per sample (0: no samples)."""
    progress: bool = True
    """Show a progress bar."""
    profile_steps: tuple[int, int] | None = None
    ("Trace steps START STOP-1 (e.g. --profile-steps 10 15) into OUT/profile: a jax.profiler trace "
     "(Perfetto/TensorBoard) and a device-memory profile; see docs/profiling.md.")
    verbose: bool = False
    ("Show what is kept out of the console by default: XLA's C++ log lines (TF_CPP_MIN_LOG_LEVEL) and JAX's "
     "warning that donated batch buffers were not reused.")
    compile_only: bool = False
    ("Compile the training step for --slice from shapes and report memory, collectives and a predicted step time "
     "(eqgpt-plan, docs/course/18-planning-for-a-pod.md); trains nothing.")
    slice: str | None = None
    """With --compile-only: the TPU slice to compile for, e.g. v5e-16, v5p-128, 2xv5e-256 (needs eqgpt[tpu-plan])."""
    log: Literal["jsonl", "tensorboard"] = "jsonl"
    ("'tensorboard': also write TensorBoard events to OUT/tb (pip install 'eqgpt[tensorboard]'); metrics.jsonl is "
     "always written.")


def strategy_of(cfg: TrainConfig) -> Strategy:
    """The run's `Strategy` (`cfg.parallel`); a mesh larger than a CPU's devices names --cpu-devices."""
    try:
        return cfg.parallel.strategy()
    except ValueError as e:
        more = cfg.parallel.mesh and jax.default_backend() == "cpu" and len(jax.devices()) == 1
        if not (more and "devices" in str(e)):
            raise
        raise ValueError(f"--mesh {cfg.parallel.mesh}: {e} On a CPU, --cpu-devices N simulates N devices "
                         f"(e.g. --cpu-devices 8 --mesh {cfg.parallel.mesh}).") from None


def policy_of(cfg: TrainConfig) -> Policy:
    """The mixed-precision policy of --precision and --master-weights."""
    if cfg.precision == "auto" and not cfg.master_weights:
        return Policy.default()
    name = cfg.precision if cfg.precision != "auto" else ("fp32" if jax.default_backend() == "cpu" else "bf16")
    return Policy.named(name, master_weights=cfg.master_weights, int8_backward=cfg.int8_backward)


def schedule_notes(cfg: TrainConfig, out: Path | None, step: int | None, plan: dict) -> list[str]:
    """With --resume: one line for a tail this resume adds, one naming --optim flags changed from the run's."""
    if not step or out is None or not (out / "config.json").is_file():
        return []
    notes, saved = [], json.loads((out / "config.json").read_text())
    was = saved["recipe"].get("optim", {})
    changed = [f"{flag_name('optim.' + k)} {getattr(cfg.optim, k)} (the run's: {was[k]})"
               for k in ("lr", "warmup_steps", "min_lr_ratio") if k in was and was[k] != getattr(cfg.optim, k)]
    now = schedule_of(cfg.optim, plan)
    if changed:
        before = schedule_of(dataclasses.replace(cfg.optim, **{
            k: was[k] for k in ("lr", "warmup_steps", "min_lr_ratio") if k in was}), plan)
        notes.append(f"changed on resume: {', '.join(changed)}; the learning rate at step {step} moves from "
                     f"{float(before(step)):.3g} to {float(now(step)):.3g}")
    if cfg.optim.extend == "restart" and cfg.steps > saved["recipe"]["steps"]:
        notes.append(f"--optim.extend restart: a new warmup and cosine over {cfg.steps} steps; the learning rate "
                     f"jumps to {float(now(step)):.3g} at step {step}")
    elif plan["tails"] and plan["tails"][-1]["from"] == step:
        t = plan["tails"][-1]
        notes.append(f"--steps {t['to']} extends the run's schedule: {t['tail']} tail from {float(now(step)):.3g} "
                     f"at step {step} to {float(now(t['to'])):.3g} at step {t['to']} (--optim.extend: cosine, "
                     "linear, constant or restart)")
    return notes


def schedule_of(o: OptimConfig, plan: dict):
    """The learning rate of the --optim flags over `plan` (`eqgpt.train.schedule_plan`)."""
    return planned_schedule(plan, lr=o.lr, warmup_steps=o.warmup_steps, min_lr_ratio=o.min_lr_ratio)


def optimizer_of(cfg: TrainConfig, policy: Policy | None = None, plan: dict | None = None):
    """AdamW with warmup and cosine decay, as the --optim flags say, over the run's `plan` (`schedule_plan`),
    with the policy's master weights, if any; **returns** (optimizer, schedule)."""
    o, policy = cfg.optim, policy or Policy()
    schedule = schedule_of(o, plan or {"planned_steps": cfg.steps, "tails": []})
    return policy.optimizer(make_optimizer(
        schedule, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, clip_norm=o.clip_norm or None,
        decay_embeddings=o.decay_embeddings, decay_norms_and_biases=o.decay_norms_and_biases,
        mu_dtype=o.mu_dtype)), schedule


def vocab_size_of(cfg: TrainConfig, model_cfg: eqgpt.GPTConfig, corpus) -> int:
    """The model's vocabulary: a token file's or folder's (flag, sidecar, meta.pkl or inferred); for text,
    --model.vocab-size, else the preset's with bytes, else the tokenizer's. Never below the tokenizer's."""
    if not corpus.pretokenized:  # text, tokenized here
        vocab = cfg.model.vocab_size or (model_cfg.vocab_size if cfg.data.tokenizer == "bytes" else corpus.vocab_size)
        if vocab < corpus.vocab_size:
            raise ValueError(f"--model.vocab-size {vocab} is below the tokenizer's {corpus.vocab_size} "
                             f"({corpus.tokenizer.name}); raise it or leave it out.")
        return vocab
    return corpus.vocab_size  # a token file: load_corpus checked every id against it


def tokenizer_decodes(corpus, model_cfg: eqgpt.GPTConfig) -> bool:
    """Whether the run's tokenizer decodes the model's ids: not for token ids above 255 whose tokenizer
    neither --data.tokenizer nor a meta.pkl names (then no samples and no bits per byte)."""
    return not (corpus.pretokenized and isinstance(corpus.tokenizer, ByteTokenizer) and model_cfg.vocab_size > 256)


def model_record(cfg: TrainConfig, model_cfg: eqgpt.GPTConfig) -> dict:
    """The model as `model_config.json` records it: the `GPTConfig` and the block factory's `module:name`."""
    return {**dataclasses.asdict(model_cfg), "block_factory": factory_path(cfg.model.block_factory())}


def write_run_config(cfg: TrainConfig, model_cfg: eqgpt.GPTConfig, out: Path, corpus, step: int, plan: dict) -> None:
    """`config.json` (and a fresh `metrics.jsonl` unless resuming), with every corpus trained on since
    (`corpora_trained`) and the learning-rate `plan`; every process checks it agrees.
    Written only once every check has passed: a refused run leaves the directory as it was."""
    corpora = corpora_trained(out, corpus_record(corpus.name, corpus.fingerprint), step, resume=cfg.resume)
    if jax.process_count() > 1:  # every process must run what process 0 runs, or stop now
        distributed.check_same_on_all_processes({"recipe": dataclasses.asdict(cfg), "model": model_cfg})
    if distributed.is_main_process():
        out.mkdir(parents=True, exist_ok=True)
        if not cfg.resume:
            (out / "metrics.jsonl").unlink(missing_ok=True)
        (out / "config.json").write_text(json.dumps(
            {"recipe": dataclasses.asdict(cfg), "model": model_record(cfg, model_cfg), "corpora": corpora,
             "schedule": plan}, indent=2, default=str))


def make_checkpointer(cfg: TrainConfig, model_cfg: eqgpt.GPTConfig, out: Path, corpus) -> Checkpointer:
    """Checkpoints every --checkpoint-every steps, and always at the end and on SIGTERM/SIGINT."""
    return Checkpointer(cfg.checkpoint_dir or out / "checkpoints", every=cfg.checkpoint_every or cfg.steps,
                        keep=cfg.checkpoint_keep, must_match=("model", "data_order"),
                        config={"model": model_cfg.architecture(), "data_order": {"seed": cfg.seed},
                                "corpus": corpus_record(corpus.name, corpus.fingerprint),
                                "recipe": dataclasses.asdict(cfg)})


# The flag that sets each field a resume compares (eqgpt.train.resume.check_resume).
RESUME_FLAGS = {"seed": "--seed", "mode": "--data.mode", "batch_size": "--batch-size", "seq_len": "--model.seq-len",
                "corpus": "--data.corpus",
                **{f"model.{f.name}": flag_name(f"model.{f.name}") for f in dataclasses.fields(ModelConfig)}}


def resume_check(cfg: TrainConfig, model_cfg: eqgpt.GPTConfig, corpus, log):
    """`check(step, saved config, saved extras)`: refuses (one line naming every differing flag) a
    checkpoint of another model, data pipeline or corpus; logs what it accepts (a moved corpus,
    --allow-new-corpus)."""
    model = json.loads(json.dumps(model_cfg.architecture(), default=str))  # as the checkpoint's JSON holds it
    data = {"seed": cfg.seed, "mode": cfg.data.mode, "seq_len": model_cfg.seq_len}
    if cfg.batch_size != "auto":
        data["batch_size"] = cfg.batch_size

    def check(step: int, saved: dict, extras: dict) -> None:
        for note in check_resume(step, saved, extras, model=model, data=data, flags=RESUME_FLAGS,
                                 corpus=corpus_record(corpus.name, corpus.fingerprint),
                                 allow_new_corpus=cfg.allow_new_corpus):
            log(note)
    return check


def finished_run(cfg: TrainConfig, resumed: Path | None, log) -> dict | None:
    """With --resume, the summary of a run that has finished --steps (said in one line), else `None`."""
    if resumed is None or (done := finished(resumed, cfg.checkpoint_dir, cfg.steps)) is None:
        return None
    log(f"run {resumed} has finished its {done['steps']} steps; nothing to do, nothing changed "
        f"(--steps N above {done['steps']} trains on)")
    return done


def resume_plan(cfg: TrainConfig, resumed: Path | None, model_cfg: eqgpt.GPTConfig, corpus) -> dict:
    """The run's learning-rate plan (`eqgpt.train.schedule_plan`); with --resume, after checking the newest
    checkpoint's model, data and corpus against these flags (`resume_check`), before anything compiles."""
    newest = (None if resumed is None else newest_checkpoint(
        checkpoint_dir_of(cfg, resumed), resume_check(cfg, model_cfg, corpus, lambda msg: None)))
    return schedule_plan(resumed, newest, cfg.steps, cfg.optim.extend)


def checkpoint_dir_of(cfg: TrainConfig, out: Path) -> Path:
    return Path(cfg.checkpoint_dir or out / "checkpoints")


def check_prompts(cfg: TrainConfig, tok) -> None:
    """Refuse --sample-prompts the corpus's tokenizer cannot encode (before training, not after)."""
    for prompt in cfg.sample_prompts if cfg.sample_tokens else ():
        try:
            tok.encode(prompt)
        except ValueError as e:
            raise ValueError(f"--sample-prompts {prompt!r}: {e}") from None


def use_compile_cache(cfg: TrainConfig) -> Path | None:
    """--compile-cache, --compile-cache-dir: `eqgpt.compile_cache.enable_compile_cache`; before the first
    compile. **Returns** its directory, or `None` when off (or set by the user already)."""
    return enable_compile_cache(cfg.compile_cache_dir) if cfg.compile_cache else None


def start_jax(cfg: TrainConfig) -> Path | None:
    """What must precede the first use of a JAX backend (XLA's flags, the CPU device count, the
    compilation cache), then the multi-process start-up; **returns** the cache directory or `None`."""
    if not cfg.verbose:  # the step donates the whole batch too; its int32 buffers cannot alias any output
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable", category=UserWarning)
    cfg.parallel.before_backend()  # XLA reads its flags when the backend starts (--overlap)
    if cfg.cpu_devices:
        jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
    compile_cache = use_compile_cache(cfg)
    distributed.initialize()  # one process: nothing; several: EQGPT_* / SLURM / Open MPI settings
    return compile_cache


def kernel_choice(model_cfg: eqgpt.GPTConfig, policy: Policy) -> str:
    """Which attention kernel the model runs, e.g. 'attention auto -> splash'."""
    if model_cfg.attention_kernel != "auto":
        return f"attention {model_cfg.attention_kernel}"
    return f"attention auto -> {kernel_name(model_cfg, policy)} ({jax.default_backend()})"


def corpus_of(cfg: TrainConfig, model_cfg: eqgpt.GPTConfig):
    """The --data corpus, checked (its prompts encodable); **returns** it and `model_cfg` with its vocabulary."""
    corpus = load_corpus(cfg.data.corpus, cache_dir=cfg.data.cache_dir, val_percent=cfg.data.val_percent,
                         min_tokens=model_cfg.seq_len + 1, vocab_size=cfg.model.vocab_size,
                         tokenizer=cfg.data.tokenizer, progress=cfg.progress and distributed.is_main_process())
    model_cfg = model_cfg.replace(vocab_size=vocab_size_of(cfg, model_cfg, corpus))
    check_prompts(cfg, corpus.tokenizer)
    if cfg.data.mode == "packed" and corpus.train_docs is None:
        raise ValueError(f"--data.mode packed needs document boundaries, which {cfg.data.corpus} lacks: put "
                         "NAME.docs.npy ([0, end_0, ..., n_tokens]) beside the token file, or use --data.mode windows.")
    return corpus, model_cfg


def compiled_step(cfg: TrainConfig, optimizer, strategy: Strategy, policy: Policy, model_like, state, compiled,
                  batch: Batch):
    """The training step compiled once, for batches shaped as `batch` (the loader's first): `compiled`, from
    `fit_batch`, when it has one for `windows` batches. Compiled before the run directory is made, so that a
    step that cannot compile leaves nothing behind; --report and --estimate read this very program."""
    if compiled is not None and cfg.data.mode == "windows":
        return compiled
    step_fn = make_train_step(optimizer, strategy=strategy, policy=policy, accum_steps=cfg.accum_steps,
                              z_loss=cfg.z_loss, model_like=model_like)
    return step_fn.lower(state, strategy.batch(batch)).compile()


def sampler_of(cfg: TrainConfig, corpus, model_cfg: eqgpt.GPTConfig):
    """The end-of-run samples' inputs as a function of the state (`eqgpt.train.finish.sample_inputs` of
    --sample-prompts and --sample-tokens); `None`: none asked for, or no tokenizer decodes the model's ids."""
    if not (cfg.sample_tokens and tokenizer_decodes(corpus, model_cfg)):
        return None
    return functools.partial(sample_inputs, tokenizer=corpus.tokenizer, prompts=cfg.sample_prompts,
                             max_new=cfg.sample_tokens, seq_len=model_cfg.seq_len)


def validation_windows(cfg: TrainConfig, corpus, model_cfg: eqgpt.GPTConfig):
    """The validation windows of --eval-windows (`None` without)."""
    if not cfg.eval_windows:
        return None
    return eval_windows(corpus.val, seq_len=model_cfg.seq_len, num_windows=cfg.eval_windows)


def trainer_config(cfg: TrainConfig, corpus, model_cfg: eqgpt.GPTConfig, out: Path, val) -> TrainerConfig:
    """The `Trainer`'s settings from the flags; `val`: the validation windows."""
    return TrainerConfig(steps=cfg.steps, log_every=cfg.log_every, eval_every=cfg.eval_every, out_dir=out,
                         progress=cfg.progress, log=cfg.log, profile_steps=cfg.profile_steps,
                         max_skipped=cfg.max_skipped, divergence_factor=cfg.divergence_factor,
                         divergence_window=cfg.divergence_window,
                         bytes_per_token=None if val is None or not tokenizer_decodes(corpus, model_cfg)
                         else bytes_per_token(corpus.tokenizer, val[:, 1:]))


def main(cfg: TrainConfig) -> dict:
    """Run the recipe; **returns** a summary (`val_loss`, `steps`, `seconds`, `samples`)."""
    t0, compiles = time.perf_counter(), CompileLog()  # this run's compiles, by phase
    check_run_flags(cfg)  # before start-up: an error is the only output, not mixed with the backend's
    compile_cache = start_jax(cfg)
    log = (lambda msg: print(msg, flush=True)) if distributed.is_main_process() else (lambda msg: None)
    resumed = run_to_continue(cfg.out_dir, cfg.checkpoint_dir, resume=cfg.resume)
    if (done := finished_run(cfg, resumed, log)) is not None:
        return done
    model_cfg, block_factory = cfg.model.build(), cfg.model.block_factory()
    cfg.model.check_kernel(model_cfg)
    strategy, policy = strategy_of(cfg), policy_of(cfg)  # every flag error is raised here or in `check`
    corpus, model_cfg = corpus_of(cfg, model_cfg)
    plan = resume_plan(cfg, resumed, model_cfg, corpus)  # checks the checkpoint's record before compiling
    make_model = lambda k: policy.cast_to_param(GPT(model_cfg, key=k, block_factory=block_factory))  # noqa: E731
    model_like = jax.eval_shape(make_model, jax.random.key(0))
    if cfg.batch_size != "auto":
        strategy.check(model_like, batch_size=cfg.batch_size, seq_len=model_cfg.seq_len, accum_steps=cfg.accum_steps)
    check_memory(cfg.batch_size, model_cfg, strategy, policy)  # before the first compile
    optimizer, schedule = optimizer_of(cfg, policy, plan)
    state = initial_state(optimizer, strategy, policy, make_model, cfg.seed)
    eval_fn = make_eval_fn(strategy.loss_fn(z_loss=cfg.z_loss, model_like=model_like), policy=policy)
    val = validation_windows(cfg, corpus, model_cfg)
    ahead = compile_ahead(state, strategy, eval_fn, val, sampler := sampler_of(cfg, corpus, model_cfg))  # meanwhile
    batch, compiled = fit_batch(cfg.batch_size, optimizer, state, strategy, policy, model_like, log=log,
                                seq_len=model_cfg.seq_len, accum_steps=cfg.accum_steps, z_loss=cfg.z_loss)
    cfg = dataclasses.replace(cfg, batch_size=batch)
    loader = make_loader(corpus.train, batch_size=cfg.batch_size, seq_len=model_cfg.seq_len, seed=cfg.seed,
                         config=LoaderConfig(cfg.data.mode, cfg.data.threads, cfg.data.prefetch),
                         docs=corpus.train_docs)
    restored = restore_run(resumed and checkpoint_dir_of(cfg, resumed), state, loader, resume_check(
        cfg, model_cfg, corpus, log), log, strict=cfg.strict, allow_fresh=cfg.allow_fresh)
    state, seconds = (state, 0.0) if restored is None else (restored.state, float(restored.extras.get("seconds", 0)))
    step_fn = compiled_step(cfg, optimizer, strategy, policy, model_like, state, compiled,
                            batch=loader.source.local_batch(0))
    # Every check has passed: only now is anything written (a refused run leaves no file and no directory).
    out, leave, forget = open_run(cfg, resumed)
    describe_run(cfg, out, compile_cache, strategy, model_like, model_cfg, corpus, log,
                 notes=schedule_notes(cfg, resumed, int(state.step), plan))
    write_run_config(cfg, model_cfg, out, corpus, int(state.step), plan)
    checkpointer = make_checkpointer(cfg, model_cfg, out, corpus)
    print_evidence(step_fn, strategy, policy, model_cfg,
                   cfg.batch_size, show_report=cfg.report, show_estimate=cfg.estimate, log=log)
    peak, peak_source = (cfg.peak_flops, "--peak-flops") if cfg.peak_flops else peak_flops()
    log(model_line(cfg, model_cfg, model_like, policy, corpus, strategy, f"{peak / 1e9:.0f} GFLOP/s ({peak_source})"))
    trainer = Trainer(step_fn, state, loader, strategy, eval_fn=ahead.get("eval") or eval_fn, schedule=schedule,
                      checkpointer=checkpointer, val_windows=val,
                      config=trainer_config(cfg, corpus, model_cfg, out, val),
                      flops_per_token=flops_per_token(model_cfg), peak_flops=peak)
    trainer.history.rows, trainer.seconds_before = earlier_rows(out, int(state.step)), seconds
    ahead.lowered()  # before the step donates the arrays they were lowered with
    try:
        state = compiles.training(trainer.run, int(trainer.state.step))
        return finish(trainer, state, out, tokenizer=corpus.tokenizer, checkpoint_dir=checkpoint_dir_of(cfg, out),
                      title=f"{cfg.model.preset} on {corpus.name} ({corpus.tokenizer.name})", sampler=sampler, t0=t0,
                      leave=leave, compiles=compiles, ahead=ahead)
    finally:
        forget()  # this run's note for a forced exit


def open_run(cfg: TrainConfig, resumed: Path | None):
    """The run directory (a new one made now, and runs/latest pointed at it when it lies in runs/);
    `leave()`: what a stop leaves (`eqgpt.train.run_dir.leave_run`), also said by a forced exit; and the
    function that withdraws it from forced exits."""
    out = resumed or new_run_dir(cfg.out_dir, cfg.model.preset)
    before = point_latest(out) if resumed is None and under_root(out) else None  # runs/latest: the newest run
    leave = lambda: leave_run(out, checkpoint_dir_of(cfg, out), new=resumed is None, latest_before=before)  # noqa: E731
    return out, leave, at_forced_exit(leave)


def model_line(cfg: TrainConfig, model_cfg, model_like, policy, corpus, strategy: Strategy, peak: str) -> str:
    """One line: the model, its kernel, the corpus, the strategy and the peak MFU is counted against."""
    n_params = sum(x.size for x in jax.tree.leaves(model_like))
    return (f"model {cfg.model.preset}: {n_params / 1e6:.2f}M params, {model_cfg.num_layers} layers x "
            f"{model_cfg.embed_dim} wide, seq {model_cfg.seq_len}, {kernel_choice(model_cfg, policy)} | "
            f"corpus {corpus.name}: {len(corpus.train) / 1e6:.1f}M train / {len(corpus.val) / 1e6:.2f}M val "
            f"tokens | {strategy!r} | peak {peak}")


def describe_run(cfg: TrainConfig, out: Path, compile_cache, strategy: Strategy, model_like, model_cfg, corpus, log,
                 notes: Sequence[str] = ()):
    """What the run is about to do: its directory, cache, buckets, pipeline stages, corpus notes, then `notes`."""
    log(f"run directory: {out}")
    if compile_cache is not None:
        log(f"compilation cache: {compile_cache} (a second start reads its programs; --no-compile-cache: off)")
    for note in strategy.notes(model_like, (cfg.batch_size // cfg.accum_steps, model_cfg.seq_len)):
        log(note)  # gradient buckets, pipeline stages
    for note in corpus.notes:
        log(note)
    if not tokenizer_decodes(corpus, model_cfg):
        log(f"{cfg.data.corpus} holds ids up to vocab {model_cfg.vocab_size} and --data.tokenizer names no tokenizer "
            "for them: no samples or bits per byte (pass the tokenizer.json or GPT-2 vocab.json that made the file)")
    for note in notes:
        log(note)


def config_from_json(cls, data: dict):
    """A (nested) config dataclass from its `dataclasses.asdict` JSON (unknown keys dropped)."""
    hints, kwargs = typing.get_type_hints(cls), {}
    if cls is TrainConfig and "parallel" not in data:  # a run from before ParallelFlags: its flags at the top
        flat = {k: v for k, v in data.items() if k in ParallelFlags.flag_names()}
        data = {**data, "parallel": dataclasses.asdict(ParallelFlags.from_flags(flat))}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value, hint = data[f.name], hints[f.name]
        nested = [t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)]
        if nested and isinstance(value, dict):
            value = config_from_json(nested[0], value)
        elif isinstance(value, list):
            value = tuple(value)
        elif isinstance(value, str) and Path in (hint, *typing.get_args(hint)):
            value = Path(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def parse_flags(args: list[str] | None = None) -> TrainConfig:
    """The command line; with --resume, flags left out default to the continued run's (its config.json).
    Every --import is imported first, so that its kernels, blocks and presets are names the flags accept."""
    import_modules(imports_in(sys.argv[1:] if args is None else args))
    cfg = parse_cli(TrainConfig, args=args)
    if not cfg.resume:
        return cfg
    try:
        saved = run_to_continue(cfg.out_dir, cfg.checkpoint_dir, resume=True) / "config.json"
    except ValueError:
        return cfg  # main says why
    if not saved.is_file():
        return cfg
    try:
        recipe = json.loads(saved.read_text())["recipe"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"--resume: {saved} is not a run's config.json (it holds no 'recipe'); name the run's "
                         "directory with --out-dir.") from None
    cfg = parse_cli(TrainConfig, args=args, default=config_from_json(TrainConfig, recipe))
    import_modules(cfg.imports)  # the continued run's own
    return cfg


def run(args: list[str] | None = None) -> None:
    """The console script `eqgpt-train`: flags -> `main`; a user error is one line and exit status
    `USER_ERROR_EXIT_CODE` (1), as in `eqgpt-sample` and `python -m eqgpt.interop`."""
    restart_with_malloc_tunables()  # keep step buffers mapped: ~30x less system time (docs/profiling_results.md)
    try:
        with StopSignal(immediate=True):  # SIGTERM/Ctrl-C before training: leave at once (a trainer takes over)
            summary = exit_on_user_error(lambda: main(parse_flags(args)), args=args)
    except Stopped as e:  # outside the training loop: before it (nothing written yet) or after it
        forced_exit(f"stopped by {e} (exit status {PREEMPTED_EXIT_CODE}).")
    sys.exit(summary.get("exit_code") or (PREEMPTED_EXIT_CODE if summary["interrupted"] else 0))


__all__ = ["DataConfig", "ModelConfig", "OptimConfig", "TrainConfig", "check_run_flags", "main", "parse_flags", "run",
           "strategy_of", "use_compile_cache"]

if __name__ == "__main__":
    run()
