"""Exact pure-JAX versions of every op: the oracle for tests and the "xla" backend."""
