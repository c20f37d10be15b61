"""Developer sessions: `nox -s tests`, `tests-3.11`, `tests-3.12`, `lint`, `docs`, `bench`, `tests_multiprocess`,
`mutants`, `mutation`.

`tests` runs the suite on both supported ends of JAX: `tests-3.11` pins the oldest
supported jax (0.10.2) on Python 3.11, `tests-3.12` installs the newest jax on
Python 3.12 (jax >= 0.11 needs Python >= 3.12). nox finds the interpreters on PATH
(with pyenv: `pyenv shell 3.11.7 3.12.1`, or `pyenv global` listing both); a
missing interpreter is reported as a skipped session, not hidden.
`.ci/run` does the same without nox.
"""

import nox

nox.options.sessions = ["lint", "tests"]
OLDEST_JAX = "0.10.2"
JAX = {"3.11": (f"jax=={OLDEST_JAX}", f"jaxlib=={OLDEST_JAX}"), "3.12": ("--upgrade", "jax", "jaxlib")}


@nox.session(python=list(JAX))
def tests(session: nox.Session) -> None:
    """The whole suite on 8 simulated CPU devices (3 workers), oldest (3.11) and newest (3.12) JAX."""
    session.install("-e", ".[test]", *JAX[session.python])
    session.run("python", "-c", "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)")
    session.run("python", "-m", "pytest", "-n", "3", *session.posargs)


@nox.session
def tests_multiprocess(session: nox.Session) -> None:
    """Only the tests that start several real JAX processes."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-m", "multiprocess", *session.posargs)


@nox.session
def mutants(session: nox.Session) -> None:
    """The mutation catalogue (tests/mutants): every planted bug must be caught. Slow (about an
    hour on 2 cores), so not in CI; `nox -s mutants -- --only NAME` runs some."""
    session.install("-e", ".[test]")
    session.run("python", "tests/mutants/run.py", *session.posargs)


@nox.session
def mutation(session: nox.Session) -> None:
    """Tool-driven mutation testing (mutmut 3) of one module: `nox -s mutation -- nn/mask.py`. Not in CI:
    minutes (rope) to hours (the attention mask) on 2 cores; results persist in .mutation/ (see
    tests/mutation_run.py, docs/testing.md). `-- MODULE --report` prints the table row again."""
    session.install("-e", ".[test,mutation]")
    if not session.posargs:
        session.error("name a module under src/eqgpt/: nox -s mutation -- nn/mask.py")
    session.run("python", "tests/mutation_run.py", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "recipes", "benchmarks")


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site (MkDocs + Material + mkdocstrings) offline with --strict into .nox/site/ (ignored);
    `nox -s docs -- snippets` also runs every code snippet in docs/ (tests/test_docs.py)."""
    session.install("-e", ".[docs,test]" if "snippets" in session.posargs else ".[docs]")
    if "snippets" in session.posargs:
        session.run("python", "-m", "pytest", "tests/test_docs.py", "-q")
    session.run("mkdocs", "build", "--strict", "--site-dir", ".nox/site", env={"NO_MKDOCS_2_WARNING": "1"})


@nox.session
def bench(session: nox.Session) -> None:
    """Print the benchmark tables (compile time, memory, step time)."""
    session.install("-e", ".[plot]")
    import glob

    for script in sorted(glob.glob("benchmarks/*.py")):
        session.run("python", script)
