"""The registry of Hugging Face model families: name -> `Family`, in the order `family_of` tries them."""

from __future__ import annotations

from eqgpt.interop.family import Family
from eqgpt.interop.gpt2 import GPT2
from eqgpt.interop.llama import LLAMA
from eqgpt.interop.mixtral import MIXTRAL

FAMILIES: dict[str, Family] = {f.name: f for f in (GPT2, LLAMA, MIXTRAL)}


def register_family(family: Family) -> None:
    """Add `family` (or replace the one of its name): `load_hf`, `save_hf` and the CLI then know it."""
    FAMILIES[family.name] = family


def get_family(name: str) -> Family:
    """The registered `Family` called `name`; `ValueError` listing the known ones otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"family {name!r} is not registered; known: {', '.join(FAMILIES)} "
                         "(eqgpt.interop.register_family adds one).")
    return FAMILIES[name]
