import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import sparsepage  # noqa: E402


def pytest_report_header(config):
    return (f"sparsepage {sparsepage.__version__} from {os.path.dirname(sparsepage.__file__)}; "
            f"built with CUDA: {sparsepage.built_with_cuda()}; GPU visible: {sparsepage.cuda_available()}")


@pytest.fixture
def rng():
    import numpy as np

    return np.random.default_rng(1234)
