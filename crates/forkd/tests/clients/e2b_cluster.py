"""E2B's own SDK (`e2b` from PyPI, unmodified) against one host of a forkd cluster
whose template is on another host: the create is handed there, and every later call
reaches the sandbox through this host's listener; the list is the cluster's.
E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY point it at the host; the template is
FORKD_TEST_SNAPSHOT, and FORKD_OTHER_SANDBOXES names sandboxes the other host holds.
Prints `ok` when every step held."""

import os

from e2b import Sandbox, SandboxQuery, SandboxState

template = os.environ["FORKD_TEST_SNAPSHOT"]
others = set(os.environ["FORKD_OTHER_SANDBOXES"].split(","))
run = f"e2b cluster {os.getpid()}"

sbx = Sandbox.create(template, timeout=300, metadata={"suite": run})
r = sbx.commands.run("hostname")
assert r.stdout.strip() == sbx.sandbox_id, r
sbx.files.write("cluster.txt", "through another host")
assert sbx.files.read("cluster.txt") == "through another host"

# The cluster's list: the other host's sandboxes and this one, all running.
listed: set[str] = set()
pages = Sandbox.list(query=SandboxQuery(state=[SandboxState.RUNNING]), limit=1)
while pages.has_next:
    listed.update(s.sandbox_id for s in pages.next_items())
assert others | {sbx.sandbox_id} <= listed, (listed, others, sbx.sandbox_id)
mine = Sandbox.list(query=SandboxQuery(metadata={"suite": run})).next_items()
assert [s.sandbox_id for s in mine] == [sbx.sandbox_id], mine

# Reached again by id, through this host.
again = Sandbox.connect(sbx.sandbox_id)
assert again.files.read("cluster.txt") == "through another host"
sbx.kill()
assert Sandbox.list(query=SandboxQuery(metadata={"suite": run})).next_items() == []
print("ok")
