"""`eqgpt-plan`: train for a pod you do not have. Compiles the recipe's own training step for a TPU
slice from shapes alone (libtpu's compile-only devices; no TPU needed) and prints memory per chip,
every collective, and a predicted step time, tokens/s and MFU; `--mesh auto` searches meshes.

    eqgpt-plan --model.preset llama-1b --slice v5e-16 --mesh fsdp=16 --batch-size 64 --precision bf16
    eqgpt-plan --model.preset llama-8b --slice v5e-256 --mesh auto --batch-size 256
    eqgpt-train --compile-only --slice v5e-16 --mesh fsdp=16 --strategy fsdp ...   # the same

Its flags are eqgpt-train's (`TrainConfig`), plus --json and --top. Needs `pip install 'eqgpt[tpu-plan]'`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Any

from eqgpt.cli import exit_on_user_error, imports_in, parse_cli
from eqgpt.cli.train import TrainConfig, optimizer_of
from eqgpt.nn.factory import import_modules
from eqgpt.parallel import ParallelFlags
from eqgpt.parallel.mesh import AXES, MeshConfig
from eqgpt.parallel.pipeline.part import Pipeline
from eqgpt.plan.slices import has_libtpu, parse_slice

# Rule presets a mesh axis needs when --strategy is left at its default (the plan infers them).
_AXIS_RULES = {"data": "dp", "fsdp": "fsdp", "tensor": "sp"}


@dataclass
class PlanConfig(TrainConfig):
    """Compile the training step for a TPU slice from shapes; print memory, collectives and a predicted step time.

    Flags are eqgpt-train's; --slice names the slice (default v5e-16), --mesh auto searches meshes.

    Example: eqgpt-plan --model.preset llama-1b --slice v5e-16 --mesh fsdp=16 --batch-size 64 --precision bf16
    """

    slice: str | None = "v5e-16"
    """The TPU slice: v5e-16, v5e-256, v5p-128, v6e-64, v4-32, ...; K slices joined by DCN: 2xv5e-256."""
    json: bool = False
    """Print the report as JSON."""
    top: int = 3
    """With --mesh auto: how many of the candidates the memory estimate ranks best are compiled."""


def rules_for(cfg: TrainConfig) -> str:
    """--strategy, or where it is left at 'dp' the presets the --mesh axes need (fsdp=16 -> 'fsdp')."""
    if cfg.parallel.rules != "dp" or not cfg.parallel.mesh:
        return cfg.parallel.rules
    mesh = MeshConfig.parse(cfg.parallel.mesh)
    presets = [_AXIS_RULES[a] for a in AXES if a in _AXIS_RULES and getattr(mesh, a) not in (1,)]
    return "+".join(presets) or "dp"


def policy_for_tpu(cfg: TrainConfig):
    """--precision for a TPU: 'auto' is bf16 there."""
    from eqgpt.precision import Policy

    name = "bf16" if cfg.precision == "auto" else cfg.precision
    return Policy.named(name, master_weights=cfg.master_weights)


def compiled_plan(cfg: TrainConfig, slice_, devices) -> tuple[Any, Any, Any, Any]:
    """The step of `cfg` compiled for `devices`: **returns** (compiled, strategy, model config, policy).
    Raises the trainer's `ValueError`s (and `DoesNotFit`) for flags that cannot work."""
    from eqgpt.nn.kernels.platform import compiling_for
    from eqgpt.plan.compile import compile_step

    with compiling_for("tpu"):  # the TPU's defaults (layer scan), not the host's
        model_cfg = cfg.model.build()
    cfg.model.check_kernel(model_cfg)
    # Without --mesh: data parallelism over the slice (one device too: a mesh keeps the step on the slice).
    parallel = dataclasses.replace(cfg.parallel, rules=rules_for(cfg), mesh=cfg.parallel.mesh or "data=-1")
    strategy = parallel.strategy(devices)
    policy = policy_for_tpu(cfg)
    optimizer, _ = optimizer_of(cfg, policy)
    compiled = compile_step(model_cfg, strategy, policy, optimizer, batch_size=cfg.batch_size,
                            accum_steps=cfg.accum_steps, z_loss=cfg.z_loss, block_factory=cfg.model.block_factory(),
                            hbm_bytes=slice_.chip.hbm_bytes // slice_.chip.devices_per_chip)
    return compiled, strategy, model_cfg, policy


def pallas_attention(model_cfg, policy) -> bool:
    """Whether the model's attention runs in a Pallas kernel on a TPU (flash or splash)."""
    from eqgpt.nn.kernels import auto_kernel_name
    from eqgpt.nn.mask import make_mask

    name = model_cfg.attention_kernel
    if name == "auto":
        name = auto_kernel_name(make_mask(model_cfg.mask, model_cfg.window), model_cfg.seq_len, model_cfg.seq_len,
                                policy.compute, platform="tpu")
    return name in ("flash", "splash")


def record_of(cfg: TrainConfig, slice_, compiled, strategy, model_cfg, policy) -> dict:
    """The report of one compiled plan (`eqgpt.plan.report.plan_record`) with its prediction."""
    from eqgpt.plan.calibration import load
    from eqgpt.plan.model import predict
    from eqgpt.plan.report import plan_record

    pipeline = strategy.part(Pipeline)
    prediction = predict(compiled, mesh=strategy.mesh, slice_=slice_, model_cfg=model_cfg, batch_size=cfg.batch_size,
                         accum_steps=cfg.accum_steps, calibration=load(slice_.chip.name),
                         pallas_attention=pallas_attention(model_cfg, policy),
                         microbatches=pipeline.microbatches if pipeline is not None else 1)
    return plan_record(compiled, prediction, slice_=slice_, mesh=strategy.mesh, describe=strategy.describe(),
                       model=cfg.model.preset, batch_size=cfg.batch_size)


def plan_main(cfg: TrainConfig) -> dict:
    """Compile for --slice and print the report (`eqgpt-plan`, `eqgpt-train --compile-only`);
    **returns** the report as a dict. Bad flags raise `ValueError` before anything compiles."""
    if cfg.slice is None:
        raise ValueError("--compile-only needs --slice, e.g. --slice v5e-16 (the TPU slice to compile for).")
    if cfg.batch_size == "auto":
        raise ValueError("--batch-size auto: planning needs a number, e.g. --batch-size 64.")
    slice_ = parse_slice(cfg.slice)
    if not has_libtpu():
        raise ValueError("planning for a TPU slice needs libtpu: pip install 'eqgpt[tpu-plan]' "
                         "(jax[tpu] at your jax's version).")
    devices = slice_.devices()
    as_json = getattr(cfg, "json", False)
    if cfg.parallel.mesh.strip() == "auto":
        result = search(cfg, slice_, devices, top=getattr(cfg, "top", 3), log=(lambda m: None) if as_json else print)
        print(json.dumps(result, indent=1) if as_json else result["text"])
        return {**result, "interrupted": False}
    compiled, strategy, model_cfg, policy = compiled_plan(cfg, slice_, devices)
    record = record_of(cfg, slice_, compiled, strategy, model_cfg, policy)
    if as_json:
        print(json.dumps(record, indent=1))
    else:
        from eqgpt.plan.report import plan_text

        print(plan_text(record))
    return {**record, "interrupted": False}


def candidate_config(cfg: TrainConfig, c) -> TrainConfig:
    """`cfg` with a search candidate's mesh, rules, parts and remat."""
    values = {"mesh": c.mesh, "strategy": c.rules, **{k: int(v) if v.isdigit() else v for k, v in c.flags}}
    return dataclasses.replace(cfg, parallel=ParallelFlags.from_flags(values),
                               model=dataclasses.replace(cfg.model, remat=c.remat))


def search(cfg: TrainConfig, slice_, devices, *, top: int, log) -> dict:
    """--mesh auto: candidates pruned by the memory estimate, the `top` fastest by a rough time and plain
    fsdp over every device (remat full where the estimate exceeds HBM without it) compiled and predicted;
    **returns** the ranked records and their table."""
    import jax

    from eqgpt.nn import GPT
    from eqgpt.nn.kernels.platform import compiling_for
    from eqgpt.plan.search import SLACK, Candidate, mesh_choices, ranked
    from eqgpt.profile import estimate
    from eqgpt.train.fit import DoesNotFit

    with compiling_for("tpu"):
        model_cfg = cfg.model.build()
    policy = policy_for_tpu(cfg)
    hbm = slice_.chip.hbm_bytes // slice_.chip.devices_per_chip
    model_like = jax.eval_shape(lambda k: GPT(model_cfg, key=k), jax.random.key(0))

    def estimate_of(c):
        try:
            strategy = candidate_config(cfg, c).parallel.strategy(devices)
            strategy.check(model_like, batch_size=cfg.batch_size, seq_len=model_cfg.seq_len,
                           accum_steps=cfg.accum_steps)
            e = estimate(model_cfg.replace(remat=c.remat), strategy=strategy, batch=cfg.batch_size, policy=policy)
        except ValueError:
            return None
        return e.arguments + e.temporaries

    choices = mesh_choices(model_cfg, len(devices), cfg.batch_size)
    order = ranked(choices, model_cfg, slice_, cfg.batch_size, estimate_of, hbm)
    # Plain fsdp over every device: remat none where the estimate allows it (full if that does not fit), else full.
    plain = [Candidate((("fsdp", len(devices)),), "fsdp", (), remat) for remat in ("none", "full")]
    need = estimate_of(plain[0])
    baselines = [plain[0] if need is not None and need <= SLACK * hbm else plain[1]]
    log(f"--mesh auto: {len(choices)} meshes and flag sets, {len(order)} within the memory estimate's slack; "
        f"compiling the {top} fastest by a rough time that trace, and {baselines[0].mesh} "
        f"(remat {baselines[0].remat})")
    rows, compiled_ok, queue = [], 0, [*order, *baselines]
    for c in queue:  # refusals are cheap (at trace time): go down the ranking
        if c not in baselines and (compiled_ok >= top or c.sizes == plain[0].sizes):
            continue
        sub = candidate_config(cfg, c)
        try:
            compiled, strategy, mcfg, pol = compiled_plan(sub, slice_, devices)
            rec = record_of(sub, slice_, compiled, strategy, mcfg, pol)
        except DoesNotFit as e:
            rec = {"error": str(e)}
            if c == plain[0]:
                baselines.append(plain[1])
                queue.append(plain[1])
        except (ValueError, TypeError) as e:  # the strategy refuses it, or JAX cannot trace it
            rec = {"error": f"refused: {str(e).splitlines()[0]}"}
        rec["candidate"] = {"mesh": c.mesh, "args": c.args(), "baseline": c in baselines, "estimate": c.estimate}
        compiled_ok += "refused" not in rec.get("error", "")
        log(f"  {c.mesh} {' '.join(c.args()[4:])}: "
            + (f"MFU {100 * rec['mfu']:.1f}%" if "mfu" in rec else rec["error"][:160]))
        rows.append(rec)
    fitting = sorted((r for r in rows if "mfu" in r), key=lambda r: -r["mfu"])
    best = fitting[0] if fitting else None
    command = None if best is None else " ".join([
        "eqgpt-train", "--model.preset", cfg.model.preset, "--batch-size", str(cfg.batch_size), "--precision",
        "bf16" if cfg.precision == "auto" else cfg.precision, *best["candidate"]["args"]])
    return {"ranked": fitting, "failed": [r for r in rows if "mfu" not in r], "command": command,
            "text": search_text(fitting, rows, command)}


def search_text(fitting: list[dict], rows: list[dict], command: str | None) -> str:
    """The ranked table of a search."""
    from rich.table import Table

    from eqgpt.profile.text import table_text

    table = Table(title="--mesh auto: compiled candidates, best predicted MFU first")
    for col in ("mesh", "flags", "GiB per device", "step ms", "tokens/s", "MFU"):
        table.add_column(col, justify="left" if col in ("mesh", "flags") else "right")
    for r in [*fitting, *(r for r in rows if "mfu" not in r)]:
        c = r["candidate"]
        flags = " ".join(c["args"][2:]) + (" (plain fsdp)" if c["baseline"] else "")
        if "mfu" in r:
            table.add_row(c["mesh"], flags, f"{r['memory']['needed'] / 2**30:.2f}", f"{1e3 * r['time']['step']:.1f}",
                          f"{r['tokens_per_second']:,.0f}", f"{100 * r['mfu']:.1f}%")
        else:
            table.add_row(c["mesh"], flags, "does not fit" if "needs" in r["error"] else "refused", "-", "-", "-")
    tail = f"\nbest: {command}" if command else "\nno candidate fits: try a smaller --batch-size"
    return table_text(table, width=140) + tail


def run(args: list[str] | None = None, *, from_trainer: bool = False) -> None:
    """The console script `eqgpt-plan` (and `eqgpt-train --compile-only`, `from_trainer`, where --slice
    has no default): flags -> `plan_main`; a user error is one line and exit status 1."""
    argv = sys.argv[1:] if args is None else args
    import_modules(imports_in(argv))

    def plan():
        if from_trainer and not any(a.split("=")[0] == "--slice" for a in argv):
            raise ValueError("--compile-only needs --slice, e.g. --slice v5e-16 (the TPU slice to compile for).")
        return plan_main(parse_cli(PlanConfig, args=args))

    exit_on_user_error(plan, args=args)


if __name__ == "__main__":
    run()
