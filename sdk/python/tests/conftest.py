"""The tests run against a real daemon: ``FORKD_URL`` names it and
``FORKD_TEST_SNAPSHOT`` a snapshot of the ``python`` template on it (the Rust test
``crates/forkd/tests/clients.rs`` starts both and runs pytest)."""

from __future__ import annotations

import os
from typing import Iterator

import pytest

from forkd import Connection, Sandbox


@pytest.fixture(scope="session")
def snapshot() -> str:
    tag = os.environ.get("FORKD_TEST_SNAPSHOT")
    if not tag or not os.environ.get("FORKD_URL"):
        # A suite that quietly skips proves nothing: without a daemon it fails.
        pytest.fail(
            "set FORKD_URL to a daemon and FORKD_TEST_SNAPSHOT to a python snapshot on it "
            "(cargo test -p forkd --test clients does both)"
        )
    return tag


@pytest.fixture(scope="session")
def sbx(snapshot: str) -> Iterator[Sandbox]:
    """One sandbox shared by the tests that only run things in it."""
    with Sandbox.create(snapshot=snapshot, labels={"suite": "sdk"}) as s:
        yield s


@pytest.fixture()
def conn() -> Iterator[Connection]:
    c = Connection()
    yield c
    c.close()
