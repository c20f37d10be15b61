"""Developer sessions: `nox -s tests`, `lint`, `docs`, `bench`, `tests_multiprocess`."""

import nox

nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    """The whole suite on 8 simulated CPU devices (2 workers)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-n", "2", *session.posargs)


@nox.session
def tests_multiprocess(session: nox.Session) -> None:
    """Only the tests that start several real JAX processes."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-m", "multiprocess", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "recipes", "benchmarks")


@nox.session
def docs(session: nox.Session) -> None:
    """Run every code snippet in docs/ (the snippets are tests too)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "tests/test_docs.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Print the benchmark tables (compile time, memory, step time)."""
    session.install("-e", ".[plot]")
    import glob

    for script in sorted(glob.glob("benchmarks/*.py")):
        session.run("python", script)
