"""The suite's runtime type checker (the import hook of `conftest.py`): beartype, with PEP 484's
numeric tower (an `int` is accepted where `float` is annotated, as type checkers accept it)."""

from beartype import BeartypeConf, beartype

check = beartype(conf=BeartypeConf(is_pep484_tower=True))
