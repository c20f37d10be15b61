"""Runtime type checks reach every module of eqgpt (the import hook of `conftest.py`)."""

import importlib
import inspect
import pkgutil
import sys

import jax

import eqgpt
from eqgpt import nn
from eqgpt import parallel as par
from eqgpt.data import Batch
from eqgpt.parallel import Manual, Strategy, tensor
from eqgpt.parallel.manual import manual_loss_fn
from helpers import TINY


def _instrumented(fn) -> bool:
    """Whether `fn`, or a function it wraps, is jaxtyping's `jaxtyped` wrapper."""
    while fn is not None:
        if "jaxtyping" in getattr(getattr(fn, "__code__", None), "co_filename", ""):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _own_functions(module):
    """Functions defined in `module`: at its top level and in its classes' bodies (not
    `async def` ones: the hook instruments `def` only, and the package's one is Orbax's hook)."""
    for value in vars(module).values():
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            yield value.__qualname__, value
        elif inspect.isclass(value) and value.__module__ == module.__name__:
            for name, member in vars(value).items():
                member = getattr(member, "__func__", member)  # static and class methods
                if inspect.isfunction(member) and member.__module__ == module.__name__ and not name.startswith("__"):
                    yield f"{value.__qualname__}.{name}", member


def test_every_module_is_instrumented():
    names = ["eqgpt", *(m.name for m in pkgutil.walk_packages(eqgpt.__path__, "eqgpt."))]
    unchecked = []
    for name in names:
        module = sys.modules.get(name) or importlib.import_module(name)
        unchecked += [f"{name}.{q}" for q, fn in _own_functions(module)
                      if not _instrumented(fn) and not inspect.iscoroutinefunction(fn)]
    assert len(names) > 50
    assert not unchecked, f"functions without runtime type checks (imported outside the hook?): {unchecked[:10]}"


def test_the_check_catches_a_plain_function():
    def plain(x: int) -> int:
        return x

    assert not _instrumented(plain)
    assert _instrumented(tensor.vocab_parallel_loss_sums)


def test_the_manual_loss_is_checked_on_its_return():
    """`vocab_parallel_loss_sums` returns 4 values; annotated with 3 (as it was), tracing this fails."""
    model = nn.GPT(TINY, key=jax.random.key(0))
    mesh = par.make_mesh("data=2,tensor=4")
    tokens = jax.random.randint(jax.random.key(1), (2, TINY.seq_len + 1), 0, TINY.vocab_size)
    batch = Strategy(mesh, "dp", parts=(Manual(),)).batch(Batch.from_windows(tokens))
    loss, _ = jax.eval_shape(manual_loss_fn(model, mesh, chunk_size=8), model, batch)
    assert loss.shape == ()
