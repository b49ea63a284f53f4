"""Which `KVLayout` a KV cache was built for, decided once when the runner is built.

The `kv_layout` setting picks the cache `create_runtime` builds (a `VirtualKVCache` for
"vattention"); the cache's class then names its layout, so a runner built by hand around either
cache (tests, benchmarks) gets the same layout the server would.
"""

from __future__ import annotations

from chatstore.engine.kv_cache import PagedKVCache
from chatstore.engine.kv_layout import KVLayout, PagedLayout
from chatstore.engine.vattention.kv_cache import VirtualKVCache
from chatstore.engine.vattention.layout import VAttentionLayout


def layout_of(kv_cache: PagedKVCache) -> KVLayout:
    if isinstance(kv_cache, VirtualKVCache):
        return VAttentionLayout(kv_cache)
    return PagedLayout(kv_cache)
