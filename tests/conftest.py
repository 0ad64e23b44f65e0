import zlib

import jax
import pytest

jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true", help="run tests that need a GPU")
    parser.addoption("--slow", action="store_true", help="run slow CPU tests")


def pytest_collection_modifyitems(config, items):
    gpu = config.getoption("--gpu")
    slow = config.getoption("--slow") or gpu
    skip_gpu = pytest.mark.skip(reason="needs --gpu")
    skip_slow = pytest.mark.skip(reason="slow; run with --slow")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        if "slow" in item.keywords and not slow:
            item.add_marker(skip_slow)


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
