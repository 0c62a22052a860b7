"""Prometheus metrics of the paged KV cache (docs/observability.md): read from the live decoder at each scrape, so
the decode loop pays nothing for them. The same numbers are in GetInfo's details (engine.info())."""

from __future__ import annotations

import weakref

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# metric name (meshrl_rollout_ + key) -> (kind, help) for each key of PagedDecoder.metrics()
METRICS = {
    "kv_blocks_total": ("gauge", "Blocks of the paged KV cache"),
    "kv_blocks_used": ("gauge", "KV blocks held by running rows and pinned episodes"),
    "kv_blocks_free": ("gauge", "KV blocks an allocation can take (free, or cached and held by no row)"),
    "kv_blocks_cached": ("gauge", "KV blocks in the prefix cache"),
    "prefix_cache_hit_rate": ("gauge", "Share of looked-up full prompt blocks found in the prefix cache"),
    "preemptions": ("counter", "Rows preempted when the KV cache was full (each resumes later)"),
    "prefill_tokens": ("counter", "Tokens fed by prefills"),
    "prefill_tokens_saved": ("counter", "Prompt tokens not fed: found in the prefix cache or forked from a group's prefill"),
    "evicted_blocks": ("counter", "Cached KV blocks evicted (least recently used) for new rows"),
    "invalidated_blocks": ("counter", "Cached KV blocks dropped because the weights changed"),
    "kv_blocks_pinned": ("gauge", "KV blocks pinned by live episodes for their next turn"),
    "pinned_episodes": ("gauge", "Episodes whose KV is pinned between turns"),
    "episode_pin_hits": ("counter", "Episode turns that started from their pinned KV"),
    "episode_unpins": ("counter", "Episodes unpinned before they ended (pin budget or a full pool)"),
}


class _PagedKV:
    def __init__(self):
        self.decoders: weakref.WeakSet = weakref.WeakSet()

    def collect(self):
        decoders = list(self.decoders)
        if not decoders:
            return
        values = [d.metrics() for d in decoders]
        for key, (kind, text) in METRICS.items():
            total = sum(v[key] for v in values) if key != "prefix_cache_hit_rate" else values[-1][key]
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(f"meshrl_rollout_{key}", text, value=total)


_collector = _PagedKV()
REGISTRY.register(_collector)


def watch(decoder) -> None:
    """Reports `decoder`'s metrics at each scrape while it lives."""
    _collector.decoders.add(decoder)
