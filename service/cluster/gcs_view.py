"""Read the Ray cluster's nodes and free resources in a child process, so that Ray's GCS client never runs inside
the API process.

Ray's C++ GCS client aborts its whole process when it cannot reach the GCS for a minute ("Failed to connect to GCS
within 60 seconds ... The program will terminate"): a dead head must not take the service with it. ``GcsView`` keeps
one child (``python -m service.cluster.gcs_view ADDRESS``) that holds the GCS client and answers one JSON line per
request on its stdout. Every request is bounded by a timeout; a child that hangs, dies or aborts is killed and
started again on the next request, and a GCS port that refuses connections fails the request at once (no child is
started against a dead head).
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any

REQUEST_TIMEOUT_S = 10.0
START_TIMEOUT_S = 60.0


class ClusterUnavailable(ConnectionError):
    """The Ray cluster's state could not be read now (the message says why)."""


def gcs_port_answers(address: str, *, timeout_s: float = 1.0) -> str | None:
    """None when the GCS port accepts connections, else why not."""
    host, _, port = address.split("://", 1)[-1].rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
    except (OSError, ValueError) as e:
        return f"the Ray GCS at {address} does not answer: {e}"
    return None


class GcsView:
    """One child process reading the GCS of ``address`` (see the module docstring)."""

    def __init__(self, address: str):
        self.address = address
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()

    def nodes(self, *, timeout_s: float = REQUEST_TIMEOUT_S) -> list[dict[str, Any]]:
        """The GCS node table, each node with its ``Available`` resources (alive nodes only)."""
        why = gcs_port_answers(self.address)
        if why is not None:
            self.close()
            raise ClusterUnavailable(why)
        with self._lock:
            started = self._proc is None or self._proc.poll() is not None
            if started:
                self._spawn()
            try:
                return self._ask("nodes", timeout_s=START_TIMEOUT_S if started else timeout_s)
            except ClusterUnavailable:
                self._kill()
                raise

    def close(self) -> None:
        with self._lock:
            self._kill()

    # ------------------------------------------------------------------------------------------- internals
    def _spawn(self) -> None:
        self._kill()
        env = dict(os.environ)
        for k in ("MESHRUN_DATABASE_URL", "MESHRUN_METRICS_TOKEN"):
            env.pop(k, None)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "service.cluster.gcs_view", self.address],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )

    def _ask(self, what: str, *, timeout_s: float) -> Any:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(what + "\n")
            proc.stdin.flush()
        except OSError as e:
            raise ClusterUnavailable(f"the Ray state reader exited ({e})") from e
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClusterUnavailable(f"the Ray GCS at {self.address} did not answer within {timeout_s:.0f}s")
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                break
        line = proc.stdout.readline()
        if not line:
            raise ClusterUnavailable(f"the Ray state reader for {self.address} exited with {proc.wait()}")
        reply = json.loads(line)
        if "error" in reply:
            raise ClusterUnavailable(f"reading the Ray GCS at {self.address} failed: {reply['error']}")
        return reply["ok"]

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                try:
                    f.close()
                except OSError:
                    pass


# --------------------------------------------------------------------------------------------------- child
def _serve(address: str) -> None:  # pragma: no cover - runs in the child process
    from ray._private.state import GlobalState
    from ray._raylet import GcsClientOptions  # type: ignore[attr-defined]

    gs = GlobalState()
    gs._initialize_global_state(
        GcsClientOptions.create(address, None, allow_cluster_id_nil=True, fetch_cluster_id_if_nil=False)
    )
    for line in sys.stdin:
        if line.strip() != "nodes":
            continue
        try:
            table = gs.node_table()
            free = gs.available_resources_per_node()
            out = []
            for n in table:
                nid = n.get("NodeID")
                out.append(
                    {
                        "NodeID": nid,
                        "Alive": bool(n.get("Alive", n.get("alive", False))),
                        "NodeManagerAddress": n.get("NodeManagerAddress"),
                        "Resources": {k: float(v) for k, v in (n.get("Resources") or {}).items()},
                        "Available": {k: float(v) for k, v in free.get(nid, {}).items()},
                        "Labels": dict(n.get("Labels") or {}),
                    }
                )
            reply: dict[str, Any] = {"ok": out}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":  # pragma: no cover
    _serve(sys.argv[1])
