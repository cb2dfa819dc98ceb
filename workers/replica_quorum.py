"""What a replica of ``fault_tolerance.mode: replica`` trains in a quorum, shared by the per-step replicas
(``workers.replica_ft``) and the local SGD / DiLoCo rounds (``workers.replica_rounds``). No torch, no ray."""

from __future__ import annotations


class NoPeerToHeal(RuntimeError):
    """A replacement replica found no live peer to heal from (every other replica died meanwhile)."""


def shards_of(participant: int | None, participants: int, dp: int, index: int, mode: str) -> list[int]:
    """The data shards (of ``dp``) a replica trains this step. keep: participant r of q takes s % q == r (the live
    replicas cover every shard); shrink: replica ``index`` takes its own shard. Not participating: none."""
    if participant is None or participants < 1:
        return []
    if mode == "shrink":
        return [index]
    return [s for s in range(dp) if s % participants == participant]
