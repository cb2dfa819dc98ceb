"""The service's warm pool: a Ray Job of its own (``python -m service.cluster.warm_host --name NAME --workers N``)
that owns a ``WarmPool`` actor (``service.cluster.warm``) named ``NAME`` in the ``meshrun-warm`` namespace and
prestarts one group of ``N`` one-CPU workers (torch and the engine imported) on a node that has ``N`` CPUs, its own
node first. Run drivers find the pool by that name (``MESHRUN_WARM_POOL``) and start their workers in it
(``service.runs.warm_start``). The pool and its workers are this job's actors: stopping the job (the service does
at shutdown, ``service.control.runtime``) ends them all. The workers reserve no CPU while idle; a run's own
placement group holds its CPUs while it trains.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any, NoReturn

import ray
from ray.exceptions import ActorDiedError

from service.cluster.warm import WARM_NAMESPACE, WarmPool

REAP_EVERY_S = 15.0  # how often the pool looks for groups whose driver died without releasing them
MISSES_BEFORE_LEAVING = 3  # unanswered reaps in a row after which the pool counts as gone
RETRY_S = 3.0  # how soon an unanswered reap is tried again

logger = logging.getLogger("meshrun.warm")


def prestart_node(workers: int) -> str:
    """This process's node if it has ``workers`` CPUs, else the alive node with the most CPUs."""
    own = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    cpus = {n["NodeID"]: float(n.get("Resources", {}).get("CPU", 0)) for n in nodes}
    if cpus.get(own, 0) >= workers or not cpus:
        return own
    return max(cpus, key=lambda k: cpus[k])


def _on_term(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="meshrun's warm worker pool (a Ray Job entrypoint)")
    ap.add_argument("--name", required=True)
    ap.add_argument("--workers", type=int, required=True)
    ap.add_argument("--max-idle", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=0.0, help="stop idle groups unused this long (0: never)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _on_term)
    ray.init(
        address=os.environ.get("MESHRUN_RAY_GCS_ADDRESS") or None,
        namespace=WARM_NAMESPACE,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    pool: Any = WarmPool.options(name=args.name, namespace=WARM_NAMESPACE).remote(  # type: ignore[attr-defined]
        args.max_idle, args.idle_s or None
    )
    node = prestart_node(args.workers)
    t0 = time.monotonic()
    gid = ray.get(pool.prestart.remote([node] * args.workers, 1))
    logger.info(
        "warm pool %s: group #%d of %d workers ready on node %s in %.1f s",
        args.name, gid, args.workers, node[:12], time.monotonic() - t0,
    )  # fmt: skip
    try:
        host_pool(pool, args.name)
    finally:
        ray.get(pool.shutdown.remote(), timeout=30)
    return 0


def host_pool(pool: Any, name: str, *, every_s: float = REAP_EVERY_S, retry_s: float = RETRY_S) -> NoReturn:
    """Keep the pool while it answers (the pool lives as long as this job: the service stops it), reaping the groups
    of drivers that died and the groups idle too long (``WarmPool.reap``). Once the pool is gone (dead, or
    unanswered ``MISSES_BEFORE_LEAVING`` times in a row, ``retry_s`` apart) this process ends at once: its Ray head
    died, and its job left this driver behind (orphaned: no job is left to stop it) with Ray's error-listening thread
    spinning on the lost GCS connection, a third of a core or more for as long as the process lived (seen in
    tests/chaos/test_owned_head.py, 77 CPU seconds through the rest of a test session). The service starts a new
    pool on the restarted head."""
    misses = 0
    while True:
        time.sleep(retry_s if misses else every_s)
        try:
            ray.get(pool.reap.remote(), timeout=60)
            misses = 0
            continue
        except ActorDiedError as e:
            why = f"its pool actor died ({type(e).__name__})"
        except Exception as e:  # unreachable now: a head restarting, or a loaded machine
            misses += 1
            if misses < MISSES_BEFORE_LEAVING:
                continue
            why = f"its pool did not answer {misses} times in a row (last: {type(e).__name__}: {str(e)[:200]})"
        logger.warning("warm pool %s: leaving, %s; the service starts a new pool when its Ray head is back", name, why)
        logging.shutdown()
        os._exit(1)  # not ray.shutdown(): it waits on the lost head


if __name__ == "__main__":
    sys.exit(main())
