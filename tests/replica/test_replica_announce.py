"""A replica is counted by torchft's lighthouse before ``ReplicaWorker.ready`` returns
(``workers.replica_ft.announce``): no replica's first quorum forms without a peer that is ready. A real lighthouse
and TCPStore, no Ray."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torchft.coordination import LighthouseClient, LighthouseServer
from torchft.manager import REPLICA_ID_KEY

from workers.replica_ft import announce


def _first_quorum_alone(announced: bool) -> bool:
    """Replica 1 asks for its first quorum; replica 0 is ready (announced or not) but has not asked yet. True: the
    quorum formed with replica 1 alone."""
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=60_000, heartbeat_timeout_ms=60_000)
    address = f"http://127.0.0.1:{server.address().rsplit(':', 1)[1]}"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        store.set(REPLICA_ID_KEY, "replica_0:5a1e")  # what replica 0's Manager writes
        if announced:
            announce(address, store)
        client = LighthouseClient(address, connect_timeout=timedelta(seconds=10))
        client.heartbeat("replica_1:0b0e")
        try:
            quorum = client.quorum(replica_id="replica_1:0b0e", timeout=timedelta(seconds=2), address="a",
                                   store_address="s", step=0, world_size=1)
        except Exception as e:  # the lighthouse waits for replica 0 (up to its join timeout): no quorum in 2 s
            assert "timeout" in str(e).lower() or "deadline" in str(e).lower(), e
            return False
        return [m.replica_id for m in quorum.participants] == ["replica_1:0b0e"]
    finally:
        server.shutdown()


def test_a_ready_replica_is_waited_for_by_its_peers_first_quorum() -> None:
    assert _first_quorum_alone(announced=False)  # the race: the lighthouse has not heard from replica 0 yet
    assert not _first_quorum_alone(announced=True)
