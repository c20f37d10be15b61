"""The API reference (docs/api/*.md) covers every public module and every name in every `__all__`.

Fast and offline: no mkdocs build and no JAX compile. The test reads the pages' mkdocstrings
directives (`::: module.path` and the indented YAML `options:` under it, merged over the
handler options in mkdocs.yml) and each module's source, and follows mkdocstrings-python's
rules for what a directive renders:

- an explicit `members: [...]` list renders exactly those names, docstring or not;
- `members: false` (or `[]`) renders none;
- otherwise every member the name `filters` keep, imported names only where the module's
  `__all__` exports them, and members without a docstring only with `show_if_no_docstring`.

A name in a package's `__all__` is re-exported from the module that defines it; it counts as
rendered if the package's directive renders it or the defining module's (or any module on the
import chain in between) does. `nox -s docs` builds the real site with `--strict`.
"""

from __future__ import annotations

import ast
import importlib
import os
import pathlib
import pkgutil
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from functools import cache

import pytest
import yaml

import eqgpt

ROOT = pathlib.Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"
DIRECTIVE = re.compile(r"^:::\s*(\S+)\s*$")


@dataclass(frozen=True)
class Directive:
    page: str
    target: str
    options: dict


def handler_options() -> dict:
    """The python handler's global options in mkdocs.yml."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    for plugin in config.get("plugins", []):
        if isinstance(plugin, dict) and "mkdocstrings" in plugin:
            return dict(plugin["mkdocstrings"].get("handlers", {}).get("python", {}).get("options", {}))
    return {}


@cache
def directives() -> tuple[Directive, ...]:
    base = handler_options()
    found = []
    for page in sorted(API.glob("*.md")):
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            match = DIRECTIVE.match(line)
            if not match:
                continue
            block = []
            for nxt in lines[i + 1:]:
                if nxt.strip() and not nxt.startswith((" ", "\t")):
                    break
                block.append(nxt)
            local = yaml.safe_load(textwrap.dedent("\n".join(block))) or {}
            found.append(Directive(page.name, match.group(1), {**base, **(local.get("options") or {})}))
    return tuple(found)


def public_modules() -> list[str]:
    names = ["eqgpt"]
    for info in pkgutil.walk_packages(eqgpt.__path__, "eqgpt.", onerror=lambda name: pytest.fail(f"importing {name}")):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    return sorted(names)


def modules_with_all() -> list[str]:
    return [name for name in public_modules() if hasattr(importlib.import_module(name), "__all__")]


@cache
def module_definitions(module: str) -> dict[str, tuple]:
    """name -> ("def", has_docstring) or ("import", source_module, source_name), from the module's source."""
    mod = importlib.import_module(module)
    tree = ast.parse(pathlib.Path(mod.__file__).read_text())
    package = module if mod.__file__.endswith("__init__.py") else module.rpartition(".")[0]
    out: dict[str, tuple] = {}

    def is_doc(node) -> bool:
        return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)

    def visit(body):
        for i, node in enumerate(body):
            doc_next = i + 1 < len(body) and is_doc(body[i + 1])
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[node.name] = ("def", ast.get_docstring(node) is not None)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = ("def", doc_next)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = ("def", doc_next)
            elif isinstance(node, getattr(ast, "TypeAlias", ())):
                out[node.name.id] = ("def", doc_next)
            elif isinstance(node, ast.ImportFrom):
                source = node.module or ""
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    source = f"{base}.{source}" if source else base
                for alias in node.names:
                    out.setdefault(alias.asname or alias.name, ("import", source, alias.name))
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(node.orelse)

    visit(tree.body)
    return out


def import_chain(module: str, name: str) -> tuple[list[tuple[str, str]], bool]:
    """Every (module, name) from `module.name` to where it is defined, and whether the definition has a docstring."""
    chain = [(module, name)]
    while True:
        info = module_definitions(chain[-1][0]).get(chain[-1][1])
        assert info is not None, (f"{chain[-1][0]}.{chain[-1][1]} (in {module}.__all__) is neither defined nor "
                                  "imported there")
        if info[0] == "def":
            return chain, info[1]
        if not info[1].startswith("eqgpt"):
            return chain, False  # re-exported from another library: list it explicitly to be sure it renders
        chain.append((info[1], info[2]))


def keeps(name: str, filters) -> bool:
    """mkdocstrings-python's name filters: the last matching pattern decides; '!' excludes."""
    keep = True
    for pattern in filters or []:
        exclude = pattern.startswith("!")
        if re.search(pattern.lstrip("!"), name):
            keep = not exclude
    return keep


def renders(module: str, name: str, has_doc: bool) -> list[str]:
    """The pages whose directives render `module.name`."""
    pages = []
    for d in directives():
        if d.target == f"{module}.{name}":
            pages.append(d.page)
        elif d.target == module:
            members = d.options.get("members")
            if isinstance(members, list) and members:
                if name in members:
                    pages.append(d.page)
            elif members is None or members is True:
                if keeps(name, d.options.get("filters")) and (has_doc or d.options.get("show_if_no_docstring")):
                    pages.append(d.page)
    return pages


def test_directives_parsed():
    """The parser reads directives and their options (else the checks below would judge nothing)."""
    by_target = {d.target: d for d in directives()}
    assert "eqgpt.nn.gpt" in by_target
    assert by_target["eqgpt.profile"].options["members"] == ["report", "print_evidence"]
    assert by_target["eqgpt.profile"].options["filters"] == handler_options()["filters"]


@pytest.mark.parametrize("module", modules_with_all())
def test_all_names_in_reference(module):
    exported = importlib.import_module(module).__all__
    missing = []
    for name in exported:
        chain, has_doc = import_chain(module, name)
        if not any(renders(m, n, has_doc) for m, n in chain):
            where = " -> ".join(f"{m}.{n}" for m, n in chain)
            why = "" if has_doc else " (no docstring: needs show_if_no_docstring or an explicit members list)"
            missing.append(f"{where}{why}")
    assert not missing, (f"{module}.__all__ names the API reference (docs/api/*.md) does not render:\n"
                         + "\n".join(missing))


def test_every_public_module_documented():
    named = {d.target for d in directives()}
    with_submodules = {
        d.target for d in directives()
        if d.options.get("show_submodules") and d.options.get("members") in (None, True)
    }
    missing = [
        m for m in public_modules()
        if m not in named and not any(m.startswith(f"{p}.") for p in with_submodules)
    ]
    assert not missing, "public modules with no `::: module` directive in docs/api/*.md:\n" + "\n".join(missing)


def test_directives_name_real_modules():
    """A stale directive (a module renamed or removed) breaks the strict site build; catch it here too."""
    modules = set(public_modules())
    stale = [
        f"{d.page}: ::: {d.target}" for d in directives()
        if d.target not in modules and d.target.rpartition(".")[0] not in modules
    ]
    assert not stale, "directives naming no public module:\n" + "\n".join(stale)


def test_site_builds_strict(tmp_path):
    """The whole site (API reference included) builds with --strict: a broken link, a missing
    page in the nav or a docstring mkdocstrings cannot render fails here, in CI. (Not --quiet: it
    drops the warnings before --strict counts them, and a broken link passed.)"""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "api" / "data" / "index.html").read_text().count("make_loader") > 0
