"""`eqgpt.nn.LanguageModel` is an abstract `eqx.Module`: a model lacking a member is refused with its name."""

import re
from pathlib import Path

import equinox as eqx
import jax
import pytest

from eqgpt import nn
from eqgpt.parallel import Strategy, make_mesh
from helpers import TINY

SRC = Path(__file__).resolve().parents[1] / "src" / "eqgpt"


class Members:
    """Every member but `logical_sizes`."""

    def embed(self, tokens, positions):
        return tokens

    def run_blocks(self, x, positions, segment_ids=None):
        return x

    def norm(self, h):
        return h

    def logits(self, h):
        return h


def test_a_subclass_lacking_a_member_cannot_be_built():
    class NoSizes(nn.LanguageModel, Members):
        blocks: int

    with pytest.raises(TypeError, match="logical_sizes"):
        NoSizes(3)


def test_a_model_that_is_not_a_language_model_is_refused_by_check():
    class DuckLM(eqx.Module, Members):
        blocks: int

    for strategy in (Strategy(), Strategy(make_mesh("data=8"), "dp")):
        with pytest.raises(ValueError, match=r"DuckLM is not an eqgpt.nn.LanguageModel: it lacks \['logical_sizes'\]"):
            strategy.check(DuckLM(3), batch_size=8, seq_len=16)


def test_gpt_implements_it_and_the_library_reads_no_member_by_probing():
    model = eqx.filter_eval_shape(nn.GPT, TINY, key=jax.random.key(0))
    assert isinstance(model, nn.LanguageModel) and not nn.GPT.__abstractmethods__
    Strategy(make_mesh("data=8"), "dp").check(model, batch_size=8, seq_len=16)
    probes = [f"{p.relative_to(SRC)}:{i}" for p in SRC.rglob("*.py")
              for i, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"(getattr|hasattr)\(model", line)]
    assert not probes, f"the model contract read by probing, not through LanguageModel: {probes}"
