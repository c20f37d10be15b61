"""`ParallelFlags`: every part's settings as the recipe's flags, under one heading.

A new kind of parallelism is its module (a `Part` of its settings) plus one line in
`ParallelFlags`: here a toy part with one setting, defined below, is reached from
`recipes/train_gpt.py`'s flags.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
import tyro

from eqgpt.cli.train import config_from_json
from eqgpt.parallel import Manual, ParallelFlags, Pipeline, Zero
from eqgpt.parallel.flags import tyro_registry
from eqgpt.parallel.part import Part
from recipe_runs import load_recipe

RECIPE = load_recipe()


@dataclass(frozen=True)
class Toy(Part):
    """A toy parallelism: one setting, no behaviour."""

    size: int = 1
    """How big the toy is."""

    name = "toy"
    needs_mesh = False
    switch = "size"

    def describe(self, strategy) -> str:
        return f"toy {self.size}"


@dataclass(frozen=True)
class ToyFlags(ParallelFlags):
    toy: Toy | None = None  # the one line


def parse(*args: str, parallel: ParallelFlags | None = None):
    default = RECIPE.TrainConfig(parallel=parallel or ParallelFlags())
    return tyro.cli(RECIPE.TrainConfig, registry=tyro_registry(), args=list(args), default=default)


def test_a_toy_part_is_reached_from_the_recipe_flags():
    cfg = parse("--toy", "3", "--steps", "2", parallel=ToyFlags())
    assert cfg.parallel.toy == Toy(3) and cfg.steps == 2
    strategy = cfg.parallel.strategy()
    assert strategy.part(Toy) == Toy(3) and strategy.describe() == "single device | toy 3"
    assert parse(parallel=ToyFlags()).parallel.strategy().parts == ()


def test_recipe_flags_keep_their_spellings():
    cfg = parse("--mesh", "pipeline=2,data=4", "--strategy", "dp", "--pipeline", "1f1b", "--microbatches", "8",
                "--pipeline-layers", "3,1", "--bucket-mb", "0.5", "--zero", "1", "--offload-params")
    p = cfg.parallel
    assert (p.mesh, p.rules) == ("pipeline=2,data=4", "dp")
    assert p.pipeline == Pipeline("1f1b", 8, layers_per_stage=(3, 1), bucket_mb=0.5)
    assert p.zero == Zero(1) and p.manual is None and p.offload.params and not p.offload.opt_state
    manual = parse("--manual", "--collective-matmul", "--bucket-mb", "2").parallel
    assert manual.manual == Manual(collective_matmul=True, bucket_mb=2.0) and manual.pipeline is None
    assert parse("--zero", "0").parallel.zero is None


def test_flags_round_trip_through_the_run_config():
    cfg = parse("--mesh", "pipeline=2,data=4", "--pipeline", "zb1", "--pipeline-layers", "3,1", "--context", "ring")
    saved = json.loads(json.dumps(dataclasses.asdict(cfg), default=str))
    assert config_from_json(RECIPE.TrainConfig, saved).parallel == cfg.parallel
    resumed = tyro.cli(RECIPE.TrainConfig, registry=tyro_registry(), args=["--microbatches", "8"],
                       default=cfg)  # --resume's defaults
    assert resumed.parallel.pipeline == Pipeline("zb1", 8, layers_per_stage=(3, 1))
    old = {"mesh": "data=8", "strategy": "dp", "manual": True, "zero": 0, "microbatches": 4}  # before ParallelFlags
    assert config_from_json(RECIPE.TrainConfig, old).parallel.manual == Manual()


def test_help_groups_the_parallel_flags(capsys):
    with pytest.raises(SystemExit):
        parse("--help")
    text = capsys.readouterr().out
    box = text[text.index("parallel options"):]
    assert all(f in box for f in ("--mesh", "--strategy", "--pipeline", "--microbatches", "--context", "--expert",
                                  "--zero", "--manual", "--bucket-mb", "--offload-params", "--overlap"))
    assert "--steps" not in box.split("╰")[0]


@pytest.mark.parametrize("values, match", [
    (dict(microbatches=8), r"microbatches \(--microbatches\) is a setting of --pipeline.*add --pipeline"),
    (dict(bucket_mb=1.0), r"bucket_mb \(--bucket-mb\).*add --manual"),
    (dict(mesh="data=8", pipeline="1f1b"), r"--pipeline 1f1b .*'pipeline' axis.*--mesh data=8 has none"),
])
def test_bad_flags_name_the_flag(values, match):
    with pytest.raises(ValueError, match=match):
        ParallelFlags.from_flags(values).strategy()


def test_parse_keywords_are_the_flags():
    assert ParallelFlags.parse("data=8", "dp", manual=True, bucket_mb=1.0).parts == (Manual(bucket_mb=1.0),)
    with pytest.raises(TypeError, match="unknown parallelism flags"):
        ParallelFlags.parse("data=8", "dp", manul=True)


def test_the_recipe_logs_what_the_parts_say():
    import jax

    from eqgpt import preset
    from eqgpt.nn import GPT

    model = jax.eval_shape(lambda: GPT(preset("nano", num_layers=4, embed_dim=32, num_heads=2), key=jax.random.key(0)))
    pipeline = ParallelFlags.parse("pipeline=2,data=4", "dp", pipeline="1f1b", microbatches=2)
    (note,) = pipeline.notes(model, (16, 32))
    assert note.startswith("1f1b: p=2 m=2") and "layers per virtual stage 2,2 (equal)" in note
    manual = ParallelFlags.parse("data=8", "dp", manual=True, bucket_mb=0.01)
    assert manual.notes(model, (16, 32))[0].startswith("gradient all-reduces per step:")
    assert ParallelFlags.parse("data=8", "dp").notes(model, (16, 32)) == []


def test_the_flat_flags_are_scoped_to_the_registry_passed_to_tyro():
    """Importing eqgpt switches nothing on in tyro: without `registry=tyro_registry()` a
    `ParallelFlags` field is tyro's own dataclass (`--parallel.rules`), not the flat `--strategy`."""

    @dataclass(frozen=True)
    class Config:
        parallel: ParallelFlags = dataclasses.field(default_factory=ParallelFlags)

    assert tyro.cli(Config, args=["--parallel.strategy", "fsdp"], registry=tyro_registry()).parallel.rules == "fsdp"
    with pytest.raises(SystemExit):
        tyro.cli(Config, args=["--parallel.strategy", "fsdp"])
    assert tyro.cli(Config, args=["--parallel.rules", "fsdp"]).parallel.rules == "fsdp"


def test_a_settings_help_is_the_docstring_below_its_field(capsys):
    with pytest.raises(SystemExit):
        tyro.cli(ToyFlags, args=["--help"], registry=tyro_registry())
    out = " ".join(capsys.readouterr().out.split())
    assert "How big the toy is." in out
