"""The local shard cache: remote shards filled into a bounded folder as they stream, verified, shared by a machine.

    shards.py   ShardCache: the cache a loader reads remote shards through; it ties the parts below together
    files.py    the cache's folder: where each file of a shard lives, the flocks that guard them, file helpers
    fill.py     a shard filled into the cache under its lock, checked and published; prefetches; the download
    follow.py   a reader of a fill in progress (this process's or another's), going on from the store where it stops
    verify.py   a cached shard checked before it is served: its fill's record, a whole sha256 where it differs
    space.py    the cache's space counted across processes, room for a fill reserved or refused, nothing evicted; prune

`pipeline.io.cache.ShardCache` is `shards.ShardCache` (imported on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_attributes

if TYPE_CHECKING:
    from .shards import ShardCache

__getattr__ = lazy_attributes(__name__, {"ShardCache": ".shards"})
__all__ = ["ShardCache"]
