"""Egress policies: the bodies the SDK sends (no daemon needed), then a policy chosen at
fork and changed while the child runs, against the daemon."""

from __future__ import annotations

import asyncio
from typing import Any, Dict

import pytest

from forkd import (
    AsyncConnection,
    AsyncSandbox,
    BadRequestError,
    Network,
    Sandbox,
    SandboxInfo,
)
from forkd._api import fork_body

INFO: Dict[str, Any] = {"id": "sb-000000000000", "snapshot": "python", "status": "running"}


def test_a_policy_is_sent_whole_and_only_when_given() -> None:
    assert "network" not in fork_body("python", 1)
    body = fork_body("python", 2, network=Network(allow=["pypi.org", "*.pythonhosted.org:443"]))
    assert body["network"] == {
        "egress": "deny",
        "allow": ["pypi.org", "*.pythonhosted.org:443"],
        "deny": [],
    }
    assert Network(egress="off").to_api() == {"egress": "off", "allow": [], "deny": []}


def test_the_info_reads_a_policy_or_its_absence() -> None:
    assert SandboxInfo.from_api({**INFO, "network": None}).network is None
    assert SandboxInfo.from_api(INFO).network is None
    v = {"egress": "allow", "allow": [], "deny": ["203.0.113.0/24"]}
    assert SandboxInfo.from_api({**INFO, "network": v}).network == Network(
        egress="allow", deny=["203.0.113.0/24"]
    )


def test_a_policy_chosen_at_fork_comes_back_and_changes(snapshot: str) -> None:
    policy = Network(egress="allow", deny=["203.0.113.0/24"])
    (child,) = Sandbox.fork(snapshot, network=policy)
    with child:
        assert child.info.network == policy
        assert Sandbox.connect(child.id).info.network == policy
        assert child.set_network(Network(egress="off")).network == Network(egress="off")
        network = child.refresh().network
        assert network is not None and network.egress == "off"

        async def reopen() -> None:
            conn = AsyncConnection()
            try:
                a = await AsyncSandbox.connect(child.id, conn)
                info = await a.set_network(Network(allow=["203.0.113.7:443"]))
                assert info.network == Network(egress="deny", allow=["203.0.113.7:443"])
            finally:
                await conn.close()

        asyncio.run(reopen())
    # A deny-list means something only in allow mode: the daemon refuses it.
    with pytest.raises(BadRequestError, match="deny-list"):
        Sandbox.create(snapshot=snapshot, network=Network(deny=["203.0.113.0/24"]))
