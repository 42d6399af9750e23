import os
import shutil
import tempfile

import pytest
import torch


def cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from weightcache.arena import cuda

        return cuda.available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA and cuda-bindings")
    if cuda_ready():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def sockdir():
    """A short private directory: Unix socket paths must stay under ~107 bytes."""
    d = tempfile.mkdtemp(prefix="wc", dir="/tmp")
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
