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
import contextlib
import logging
import os
import signal
import sys
import time
from types import FrameType
from typing import Any

import ray

from service.cluster.warm import WARM_NAMESPACE, WarmPool

REAP_EVERY_S = 15.0  # how often the pool looks for groups whose driver died without releasing them

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
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGTERM, _on_term)
    ray.init(
        address=os.environ.get("MESHRUN_RAY_GCS_ADDRESS") or None,
        namespace=WARM_NAMESPACE,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )
    pool: Any = WarmPool.options(name=args.name, namespace=WARM_NAMESPACE).remote(args.max_idle)  # type: ignore[attr-defined]
    node = prestart_node(args.workers)
    t0 = time.monotonic()
    gid = ray.get(pool.prestart.remote([node] * args.workers, 1))
    logger.info(
        "warm pool %s: group #%d of %d workers ready on node %s in %.1f s",
        args.name, gid, args.workers, node[:12], time.monotonic() - t0,
    )  # fmt: skip
    try:
        while True:  # the pool lives as long as this job: the service stops it
            time.sleep(REAP_EVERY_S)
            with contextlib.suppress(Exception):
                ray.get(pool.reap.remote(), timeout=60)  # groups of drivers that died (``WarmPool.reap``)
    finally:
        ray.get(pool.shutdown.remote(), timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
