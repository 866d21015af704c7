"""The router tests' fixtures: pickers on loopback, closed after each test."""
from __future__ import annotations

import pytest

from kvship.router.pool import Pool, endpoint_from_url
from picker_utils import ADDRESSES, PickerServer


@pytest.fixture
def picker_factory():
    made: list[PickerServer] = []

    def make(addresses=ADDRESSES, policy="prefix", **kw) -> PickerServer:
        pool = Pool([endpoint_from_url(a) for a in addresses], policy)
        p = PickerServer(pool, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
