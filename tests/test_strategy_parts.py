"""`Strategy` is a fold over its parts: a part of your own plugs in through the same protocol,
and no method of `Strategy` branches on which parallelism it runs."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import eqgpt.parallel.strategy as strategy_module
from eqgpt.data import Batch
from eqgpt.nn import GPT
from eqgpt.parallel import Context, ParallelFlags, Pipeline, Strategy, make_mesh
from eqgpt.parallel.part import Part
from eqgpt.train import TrainState, make_train_step
from helpers import TINY

# The fields that once asked for a part; `Strategy`'s methods must never test them.
PART_FIELDS = {"pipeline", "context", "manual", "zero", "offload_opt_state", "offload_params"}


class LoggingPart(Part):
    """A part that changes nothing and writes down what the strategy asked of it."""

    name = "logging"
    needs_mesh = False

    def __init__(self, axes: frozenset[str] = frozenset()):
        self.log: list[str] = []
        self.claims = set(axes)

    def axes(self, strategy):
        return self.claims

    def validate(self, strategy):
        self.log.append("validate")

    def prepare(self, strategy, model):
        self.log.append("prepare")
        return model

    def check(self, strategy, model_like, *, rows, seq_len):
        self.log.append(f"check rows={rows} seq_len={seq_len}")

    def loss_fn(self, strategy, loss, *, chunk_size, z_loss, model_like):
        self.log.append("loss_fn")

        def logged(model, batch):
            self.log.append("loss traced")
            return loss(model, batch)

        return logged

    def describe(self, strategy):
        return "logged"


def test_a_part_of_your_own_plugs_in_and_training_runs():
    part = LoggingPart()
    strategy = Strategy(parts=(part,))
    assert strategy.parts == (part,) and part.log == ["validate"]
    assert strategy.describe() == "single device | logged"

    make = lambda k: GPT(TINY, key=k)  # noqa: E731
    strategy.check(jax.eval_shape(make, jax.random.key(0)), batch_size=4, seq_len=16)
    model = strategy.init_model(make, jax.random.key(0))
    optimizer = optax.adamw(1e-3)
    state = TrainState(model, strategy.init_opt_state(optimizer, model), rng=jax.random.key(1))
    step = make_train_step(optimizer, strategy=strategy, model_like=model)
    tokens = np.random.default_rng(0).integers(0, TINY.vocab_size, (4, 17)).astype(np.int32)
    batch = strategy.batch(Batch.from_windows(tokens))
    state, metrics = step(state, batch)
    loss, _ = jax.jit(strategy.loss_fn())(state.model, batch)
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(loss))
    assert part.log == ["validate", "check rows=4 seq_len=16", "prepare",
                        "loss_fn", "loss traced",  # the step's gradient of the loss
                        "loss_fn", "loss traced"]  # validation


def test_a_part_folds_after_the_built_in_ones():
    part = LoggingPart(axes=frozenset({"tensor"}))
    mesh = make_mesh("pipeline=2,data=2,tensor=2")
    with pytest.raises(ValueError, match=r"\['tensor'\].*add 'tp' or 'sp'"):
        Strategy(mesh, "dp", parts=(Pipeline("1f1b", 2),))
    strategy = Strategy(mesh, "dp", parts=(part, Pipeline("1f1b", 2)))  # tensor is claimed
    assert [type(p).__name__ for p in strategy.parts] == ["Pipeline", "LoggingPart"]
    assert strategy.describe() == "dp | pipeline 1f1b m=2 | logged"
    assert strategy.rows_divisor == 4 and "tensor" in strategy.axes_used


def test_parts_fold_in_a_fixed_order():
    strategy = ParallelFlags.parse("data=8", "dp", zero=1, manual=True, offload_opt_state=True)
    assert [type(p).__name__ for p in strategy.parts] == ["Zero", "Manual", "Offload"]
    assert strategy.describe() == "dp | zero1 | manual | optimizer state on host"
    ctx = Strategy(make_mesh("pipeline=2,context=2,tensor=2"), "tp", parts=(Context("ring"), Pipeline()))
    assert [type(p).__name__ for p in ctx.parts] == ["Pipeline", "Context"]
    assert ctx.part(Context) == Context("ring") and Strategy().part(Context) is None
    assert Strategy().parts == ()


def test_strategy_has_no_part_specific_field():
    assert [f.name for f in dataclasses.fields(Strategy)] == ["mesh", "rules", "overrides", "parts"]


def _branch_tests(tree: ast.AST):
    """The conditions of every `if`, `x if c else y`, comprehension filter and `while` in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.If | ast.IfExp | ast.While):
            yield node.test
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def test_strategy_methods_do_not_branch_per_part():
    source = inspect.getsource(strategy_module)
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Strategy")
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    assert len(methods) > 20
    offenders = []
    for method in methods:
        for test in _branch_tests(method):
            fields = {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)} & PART_FIELDS
            if fields:
                offenders.append(f"{method.name}: {ast.unparse(test)}")
        lazy = [n for n in ast.walk(method) if isinstance(n, ast.Import | ast.ImportFrom)]
        if lazy:
            offenders.append(f"{method.name}: imports inside the method")
    assert offenders == []


PARALLEL = Path(strategy_module.__file__).parent


def _part_modules() -> dict[str, Path]:
    """Module name -> file of every module under parallel/ that defines a `Part`."""
    found = {}
    for path in PARALLEL.rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.ClassDef) and any(getattr(b, "id", None) == "Part" for b in n.bases)
               for n in tree.body):
            found["eqgpt." + ".".join(path.relative_to(PARALLEL.parent).with_suffix("").parts)] = path
    return found


def test_no_part_module_imports_another():
    parts = _part_modules()
    assert len(parts) == 7, sorted(parts)
    crossing = []
    for name, path in parts.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in parts and node.module != name:
                crossing.append(f"{name} imports {node.module}")
    assert crossing == []


def test_parallel_reads_no_model_config():
    """Parts read models through `eqgpt.nn.LanguageModel` (and logical axis sizes), never a config."""
    offenders = [f"{path.relative_to(PARALLEL)}:{i}" for path in PARALLEL.rglob("*.py")
                 for i, line in enumerate(path.read_text().splitlines(), 1)
                 if "GPTConfig" in line or ".config." in line or '"config"' in line]
    assert offenders == []


def test_context_splits_the_sequence_over_its_own_axis():
    """`Context(axis=...)`: its rules, its check and its loss all use that axis (here `tensor`),
    and the loss is one device's."""
    strategy = Strategy(make_mesh("tensor=4,data=2"), "dp", parts=(Context("allgather", axis="tensor", block=4),))
    assert strategy.rules.axes("seq", "activations") == ("tensor",)
    model = GPT(TINY, key=jax.random.key(0))
    strategy.check(model, batch_size=8, seq_len=TINY.seq_len)
    with pytest.raises(ValueError, match="divisible"):
        strategy.check(model, batch_size=8, seq_len=12)  # zigzag: 2 x 4 pieces
    batch = Batch.from_windows(jax.random.randint(jax.random.key(1), (8, TINY.seq_len + 1), 0, 64))
    want = Strategy().loss_fn()(model, batch)[0]
    got = jax.jit(strategy.loss_fn())(strategy.place_model(model), strategy.batch(batch))[0]
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
