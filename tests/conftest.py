import os
import zlib


def _add_xla_flags(*flags: str):
    """Append `flags` to XLA_FLAGS, each unless the user named it (read when JAX's backend
    starts, not on import)."""
    given = os.environ.get("XLA_FLAGS", "")
    new = [f for f in flags if f.split("=")[0] not in given]
    os.environ["XLA_FLAGS"] = " ".join([given, *new]).strip()


_add_xla_flags("--xla_force_host_platform_device_count=8")  # for the sharding tests

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")


# The CPU suite spends most of its time compiling small XLA programs (interpreted kernels
# above all): XLA's legacy CPU emitters at LLVM -O0 compile them about twice as fast
# (float32 results move by a few ulp, inside every tolerance). Not with --gpu.
_FAST_CPU_COMPILE = ("--xla_cpu_use_fusion_emitters=false", "--xla_backend_optimization_level=0")


def pytest_configure(config):
    if not config.getoption("--gpu"):
        _add_xla_flags(*_FAST_CPU_COMPILE)


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="run tests that need a GPU")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu"):
        return
    skip_gpu = pytest.mark.skip(reason="needs --gpu")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


class _KeyGen:
    def __init__(self, seed: int):
        self._key = jax.random.key(seed)

    def __call__(self):
        self._key, sub = jax.random.split(self._key)
        return sub


@pytest.fixture
def getkey(request):
    # A seed per test so reruns and xdist workers draw the same inputs (`hash` of a str
    # is salted per process, crc32 is not).
    return _KeyGen(zlib.crc32(request.node.nodeid.encode()))


def pytest_runtest_logreport(report):
    # GPU runs get cut by the device's time limit before pytest's summary: with
    # PROBJAX_FAILURE_LOG set, each failure is written out as it happens.
    path = os.environ.get("PROBJAX_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            text = report.longreprtext  # its head names the assertion, its tail the values
            if len(text) > 8000:
                text = f"{text[:4000]}\n[...]\n{text[-4000:]}"
            f.write(f"== {report.nodeid} ({report.when})\n{text}\n")
