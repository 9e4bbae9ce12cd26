"""Fixtures shared by the engine's unit tests."""

import pytest
import torch
from speccycle.engine.errors import ModelLoadError
from speccycle.engine.weights.weights_gguf import default_model_path


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a busy 2-core box OpenMP's spinning threads slow small ops many times over."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_path():
    """The embedded SmolLM2 GGUF; the test is skipped, with the install command, when it is absent."""
    try:
        return default_model_path()
    except ModelLoadError as error:
        pytest.skip(str(error))
