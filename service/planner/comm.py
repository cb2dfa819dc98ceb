"""Collectives in an alpha-beta model, per algorithm and per tier. Pure arithmetic; seconds.

A process group of ``N`` ranks with ``g`` of them on each node spans ``N / g`` nodes (ranks are numbered so that
consecutive ranks fill a node: ``group``). Bandwidth (beta): every rank moves the algorithm's bytes over NVLink
at the intra-node bus bandwidth; when the group spans nodes, the bytes that leave a node share the node's network,
of which this group's ``g`` members own ``g`` GPU shares (all groups of a dimension communicate at once), so the
bottleneck is ``min(intra, g * inter)``. Latency (alpha): a ring of ``N`` takes ``N - 1`` steps per phase, each as
slow as the slowest link it crosses; NCCL's double binary tree (all-reduce across nodes) takes ``2 log2(nodes)``
network steps plus the ring inside the node; the cheaper of the two is used, as NCCL's tuner does. Every call
also pays ``collective_base_s``.

- all-reduce of ``n`` bytes: ring ``2 (N-1)/N n`` bytes per rank, ``2 (N-1)`` steps.
- all-gather / reduce-scatter (``n`` = the full, unsharded tensor): ``(N-1)/N n`` bytes, ``N - 1`` steps.
- point-to-point of ``n`` bytes: one step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from service.planner.devices import Device


class Group(NamedTuple):
    size: int
    per_node: int  # members of the group on one node

    @property
    def nodes(self) -> int:
        return max(1, math.ceil(self.size / self.per_node))


def group(*, stride: int, size: int, gpus_per_node: int) -> Group:
    """The group of ``size`` ranks spaced ``stride`` apart (consecutive ranks fill a node of ``gpus_per_node``)."""
    if size <= 1:
        return Group(1, 1)
    if stride >= gpus_per_node:
        return Group(size, 1)
    return Group(size, max(1, min(size, gpus_per_node // stride)))


class Link(NamedTuple):
    """Effective figures of one process group (after calibration factors)."""

    bandwidth: float  # bytes/s per rank at the group's bottleneck
    step_latency_s: float
    base_s: float
    intra_latency_s: float
    inter_latency_s: float
    nodes: int
    per_node: int


def link(dev: Device, g: Group, *, bandwidth_efficiency: float = 1.0, latency_scale: float = 1.0) -> Link:
    intra = dev.intra_node_bandwidth_bytes_per_s * bandwidth_efficiency
    if g.nodes <= 1:
        bw, lat = intra, dev.intra_node_latency_s
    else:
        bw = min(intra, g.per_node * dev.inter_node_bandwidth_bytes_per_s * bandwidth_efficiency)
        lat = dev.inter_node_latency_s
    return Link(
        bw,
        lat * latency_scale,
        dev.collective_base_s * latency_scale,
        dev.intra_node_latency_s * latency_scale,
        dev.inter_node_latency_s * latency_scale,
        g.nodes,
        g.per_node,
    )


def all_reduce(n_bytes: float, size: int, ln: Link) -> float:
    if size <= 1 or n_bytes <= 0:
        return 0.0
    beta = 2 * (size - 1) / size * n_bytes / ln.bandwidth
    ring = 2 * (size - 1) * ln.step_latency_s
    if ln.nodes > 1:
        tree = 2 * (ln.per_node - 1) * ln.intra_latency_s + 2 * math.log2(ln.nodes) * ln.inter_latency_s
        ring = min(ring, tree)
    return ln.base_s + ring + beta


def all_gather(n_bytes: float, size: int, ln: Link) -> float:
    """All-gather (or reduce-scatter) of a tensor of ``n_bytes`` (the full size)."""
    if size <= 1 or n_bytes <= 0:
        return 0.0
    return ln.base_s + (size - 1) * ln.step_latency_s + (size - 1) / size * n_bytes / ln.bandwidth


reduce_scatter = all_gather


def p2p(n_bytes: float, ln: Link) -> float:
    if n_bytes <= 0:
        return 0.0
    return ln.base_s + ln.step_latency_s + n_bytes / ln.bandwidth


def bucketed_exposed(total_s: float, buckets: int, hide_s: float) -> float:
    """Exposed time of ``buckets`` equal transfers (``total_s`` together) launched as a backward pass of ``hide_s``
    makes their gradients ready, one after another on one channel: bucket ``i`` is ready at ``i/B`` of the pass.
    The last one finishes at ``max(hide + c, hide/B + total)`` (c = one bucket), so what sticks out after the pass
    is ``max(c, total - hide (B - 1)/B)``."""
    if total_s <= 0:
        return 0.0
    b = max(1, buckets)
    if hide_s <= 0:
        return total_s
    return max(total_s / b, total_s - hide_s * (b - 1) / b)
