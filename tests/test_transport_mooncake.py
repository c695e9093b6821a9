"""The transport cases (transport_cases.py) over Mooncake Transfer Engine, on 127.0.0.1."""
import pytest

from transport_cases import *  # noqa: F401,F403  (the test functions and their fixtures)


@pytest.fixture
def backend() -> str:
    return "mooncake"
