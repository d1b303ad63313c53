"""Radix prefix cache for hybrid (GQA KV pages + Gated DeltaNet state) models. Pure Python: no JAX import.

A radix tree over token ids, one tree per namespace (any hashable key, None by default: different chat
templates / adapters never share). Every edge length is a multiple of ``page_size``; a node owns one KV page
id per page of its edge, and may own one GDN snapshot id meaning "the exact GDN (conv + recurrent) state of
all GDN layers after every token from the root to the end of this node". Snapshots can sit on interior
nodes (a shared system prompt, a turn end, a chunk boundary), not only on leaves. Ids are plain ints of the
caller's pools; the tree never touches device memory.

API (`RadixCache`, see each method's docstring for errors)::

    cache = RadixCache(page_size, has_gdn=True, snapshot_cost_tokens=6144, alpha=1.0)
    m = cache.match_prefix(tokens, namespace=None, touch=True) -> MatchResult(length, pages, snapshot, node,
                                                                             kv_length)
    cache.lock(m.node) / cache.unlock(m.node)
    r = cache.insert(tokens, pages, namespace=None) -> InsertResult(node, duplicates, new_pages)
    freed_id = cache.set_snapshot(tokens[:pos], snapshot_id, namespace=None) -> int | None
    cache.evict_pages(n) -> Freed(pages, snapshots);  cache.evict_snapshots(n) -> Freed(pages=[], snapshots)
    cache.reset() -> Freed;  cache.stats() -> CacheStats;  num_pages, num_snapshots, evictable_pages

Semantics:

- ``match_prefix``: `length` is the deepest page-aligned position where KV pages AND (has_gdn) a snapshot of
  exactly that position exist; without GDN the deepest KV match. `pages` cover [0, length), `snapshot` is
  the state to copy into the request's running slot, `node` ends at `length` (lock it). `kv_length` is the
  deepest KV-only match. Pass ``tokens[:-1]`` when the last prompt token must still be computed.
- Ownership: ``insert`` adopts every passed page id except `duplicates` (ids at positions the tree already
  held under another id), which stay the caller's to free; ids equal to the tree's own (the request reused
  matched pages) are neither. ``set_snapshot`` adopts the snapshot and returns the id the caller must free:
  the one it replaced, or its argument when the path is not cached. ``evict_*`` and ``reset`` return what the
  tree gives up. Every id is therefore held by exactly one of caller and tree at any time.
- Locks: ``lock(node)`` counts on the node and all its ancestors (path lock): no locked node, page or
  ancestor is ever evicted; the node's OWN snapshot is protected only while the node itself is locked, so
  snapshots of interior nodes that a running request already passed stay evictable. Copy the snapshot
  before unlocking. Splitting keeps locks exact (the new upper node inherits the path count).
- Splits happen only at page boundaries; the lower part keeps its depth and snapshot, so a snapshot always
  means "the state after `depth` tokens" and sits at an exact node boundary.

Where snapshots should be taken (the scheduler's side; Marconi, Pan et al., MLSys 2025): at the end of a
prompt's prefill and of a finished request (the last page-aligned position the state is known at), at
chunked-prefill boundaries that fall on pages, at chat-template turn ends, and at the branch point: when
``kv_length > length`` a request leaves a cached path at `kv_length`; prefilling in two pieces split there
and snapshotting after the first gives every later request on either branch a hit at the shared part.

Eviction policy (separate budgets: ``evict_pages`` for the KV pool, ``evict_snapshots`` for snapshot slots):

- Score = recency + alpha * e / (1 + e), lowest evicted first. recency maps the node's last use to [0, 1]
  over the tree's clock range; e = (prefill tokens a hit loses if the entry goes) / (memory it frees, in
  tokens of KV: page_size per page, `snapshot_cost_tokens` per snapshot). Tokens lost: for a snapshot, its
  depth minus the depth of the nearest snapshot above it (hits fall back there); for a leaf's pages, the same
  if the leaf has a snapshot, 0 if it has none (with GDN such KV can serve no hit), its edge length without
  GDN (then e is constant and the policy is plain LRU). alpha = 0 is pure LRU.
- ``evict_pages`` removes whole unlocked leaves (KV no hit can use goes first), freeing the leaf's snapshot
  with it, and may free more than asked. ``evict_snapshots`` keeps the KV; it re-scores lazily because
  dropping a snapshot makes those below it more valuable.
- Memory cost (why the weighting matters): for Qwen3.5-397B one fp32 snapshot of the 45 GDN layers is
  ~184 MiB, while KV costs ~30 KiB per token (15 attention layers, 2 KV heads x 256, bf16): one snapshot
  weighs about as much as 6k tokens of KV, so `snapshot_cost_tokens` defaults to 6144. A snapshot is worth
  its slot only if the prefix it ends is long or reused often; the score keeps long shared prefixes over
  short, recent leaves. Bookkeeping on the host is O(pages + nodes) small Python objects.
"""

from sglang_tpu_qwen.radix_cache.cache import CacheStats, Freed, InsertResult, MatchResult, RadixCache
from sglang_tpu_qwen.radix_cache.node import TreeNode

__all__ = ["CacheStats", "Freed", "InsertResult", "MatchResult", "RadixCache", "TreeNode"]
