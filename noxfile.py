"""Sessions: tests (CPU), lint, gpu_tests and bench (both in the current environment)."""

import nox

nox.options.sessions = ["tests", "lint"]


@nox.session
def tests(session):
    session.install("-e", ".[test,examples]")
    session.run("pytest", "-n", "2", *session.posargs)


@nox.session
def lint(session):
    session.install("-e", ".[dev,test,bench]")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("pyright", "src")


# The GPU machine has no network and its own CUDA jax: run there without a venv.
@nox.session(venv_backend="none")
def gpu_tests(session):
    session.run("python", "-m", "pytest", "--gpu", "-p", "no:xdist", *session.posargs)


@nox.session(venv_backend="none")
def bench(session):
    session.run("python", "-m", "bench.run", *session.posargs)
