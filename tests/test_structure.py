"""The shape of the code: one-way layers, no import cycles, one place that applies updates, a short recipe."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def module_imports() -> dict[str, set[str]]:
    """eqgpt module -> the eqgpt modules it imports when it runs (at any depth of its code; not
    the `if TYPE_CHECKING:` imports, which only name types)."""
    names = {}
    for path in (SRC / "eqgpt").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
        names[name] = path
    graph = {}
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
                node.body = []
        graph[name] = {d for d in eqgpt_imports(tree) if d in names and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_and_layers_point_one_way():
    graph = module_imports()
    assert cycles(graph) == []
    # nn knows no devices and no training; parallel knows no training loop.
    for name, deps in graph.items():
        if name.startswith("eqgpt.nn"):
            assert not {d for d in deps if d.startswith(("eqgpt.parallel", "eqgpt.train"))}, name
        if name.startswith("eqgpt.parallel"):
            assert not {d for d in deps if d.startswith("eqgpt.train")}, name


def test_updates_are_applied_only_by_make_train_step():
    pattern = re.compile(r"\b(optimizer|opt|OPTIMIZER)\.update\(")
    offenders = [str(p.relative_to(ROOT)) for folder in ("recipes", "tests", "benchmarks")
                 for p in (ROOT / folder).rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_the_recipe_main_is_short():
    tree = ast.parse((ROOT / "src" / "eqgpt" / "cli" / "train.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.end_lineno - main.lineno + 1 <= 60


MAX_FILE_LINES = 600
MAX_FUNCTION_CODE_LINES = 60
KNOWN_LONG_FILES: set[str] = set()
KNOWN_LONG_FUNCTIONS: set[str] = set()


def code_lines(node: ast.AST, lines: list[str]) -> int:
    """Lines of a function that hold code: not blank, not only a comment, not its docstring."""
    skip = set()
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        skip = set(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i in range(node.lineno, node.end_lineno + 1)
               if i not in skip and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))


def sizes() -> tuple[set[str], set[str]]:
    """Files under src/ over MAX_FILE_LINES lines, and functions (`file:name`) over MAX_FUNCTION_CODE_LINES."""
    files, functions = set(), set()
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        name = str(path.relative_to(ROOT))
        if len(lines) > MAX_FILE_LINES:
            files.add(name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and code_lines(node, lines) > MAX_FUNCTION_CODE_LINES:
                functions.add(f"{name}:{node.name}")
    return files, functions


def test_files_and_functions_are_short():
    files, functions = sizes()
    assert files == KNOWN_LONG_FILES, f"files over {MAX_FILE_LINES} lines: {sorted(files)}"
    assert functions == KNOWN_LONG_FUNCTIONS, f"functions over {MAX_FUNCTION_CODE_LINES} lines: {sorted(functions)}"


def test_the_size_check_counts_code_lines():
    source = 'def f():\n    """Doc\n\n    string."""\n    # a comment\n\n    x = 1\n    return x\n'
    node = ast.parse(source).body[0]
    assert code_lines(node, source.splitlines()) == 3  # `def`, `x = 1`, `return x`


PARALLEL = SRC / "eqgpt" / "parallel"


def eqgpt_imports(source: str | ast.AST) -> set[str]:
    """The eqgpt modules `source` imports anywhere: module level, function bodies, `TYPE_CHECKING` blocks."""
    found = set()
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("eqgpt"):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("eqgpt")}
    return found


def parallel_parts() -> dict[str, list[pathlib.Path]]:
    """Each part of `eqgpt.parallel` (a module, or a package, defining a `Part`) -> its files."""
    parts = {}
    for path in PARALLEL.rglob("*.py"):
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.ClassDef) and any(getattr(b, "id", None) == "Part" for b in n.bases)
               for n in tree.body):
            top = path.relative_to(PARALLEL).parts[0]
            files = [path] if path.parent == PARALLEL else sorted((PARALLEL / top).rglob("*.py"))
            parts[top.removesuffix(".py")] = files
    return parts


def test_the_import_scan_sees_every_place_an_import_hides():
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from eqgpt.a import X\n"
              "import eqgpt.b\ndef f():\n    from eqgpt.c import y\n    class K:\n        import eqgpt.d\n")
    assert {"eqgpt.a", "eqgpt.b", "eqgpt.c", "eqgpt.d"} <= eqgpt_imports(source)


def test_no_part_imports_another_parts_module_anywhere():
    parts = parallel_parts()
    assert {"pipeline", "context", "expert", "zero", "manual", "offload", "overlap"} <= set(parts), sorted(parts)
    crossing = []
    for part, files in parts.items():
        others = {f"eqgpt.parallel.{o}" for o in parts if o != part}
        for path in files:
            for module in eqgpt_imports(path.read_text()):
                if any(module == o or module.startswith(o + ".") for o in others):
                    crossing.append(f"{path.relative_to(PARALLEL)} imports {module}")
    assert crossing == []
