"""`RadixCache`: the page-aligned radix tree of cached prefixes (KV page ids + GDN snapshot ids).

See the package docstring (`sglang_tpu_qwen.radix_cache`) for the API contract, the ownership rules and
the eviction policy. This module holds no device memory: page ids and snapshot ids are plain ints owned by
the caller's pools; the tree only records which ids it currently owns and hands them back on eviction.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from sglang_tpu_qwen.radix_cache.eviction import page_saving_tokens, score, snapshot_saving_tokens
from sglang_tpu_qwen.radix_cache.node import TreeNode


@dataclass(frozen=True)
class MatchResult:
    """Result of `RadixCache.match_prefix`.

    length:    reusable prefix length in tokens (a multiple of page_size): KV pages AND (with GDN) a snapshot
               of the state after exactly `length` tokens exist. 0 on a miss.
    pages:     KV page ids covering tokens [0, length), ``len(pages) == length // page_size``. Still owned by
               the tree: the caller reads them, never frees them.
    snapshot:  GDN snapshot id with the state after `length` tokens (None when length == 0 or has_gdn=False).
               Still owned by the tree: the caller copies it into its running slot.
    node:      the node ending exactly at `length` (a root when 0); pass it to `lock` / `unlock`.
    kv_length: deepest page-aligned match of the KV alone (>= length). kv_length > length marks where the
               request leaves the snapshotted part of a cached path: the place for a branch-point snapshot.
    """

    length: int
    pages: list[int]
    snapshot: int | None
    node: TreeNode
    kv_length: int


@dataclass(frozen=True)
class InsertResult:
    """Result of `RadixCache.insert`.

    node:       the node ending at ``len(pages) * page_size`` (a root when no pages were given).
    duplicates: caller page ids at positions the tree already held under a different page id. Ownership of
                these stays with the caller, who must free them; every other id passed in is now owned by
                the tree (positions already holding the same id were the tree's to begin with).
    new_pages:  number of pages the tree adopted.
    """

    node: TreeNode
    duplicates: list[int]
    new_pages: int


@dataclass
class Freed:
    """Ids the tree has released (by eviction or `reset`); the caller returns them to its pools."""

    pages: list[int] = field(default_factory=list)
    snapshots: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class CacheStats:
    """Counters of a `RadixCache` (token counts are tokens, not pages).

    pages / snapshots / nodes: held now; locked_pages: pages on locked paths; evictable_pages: the rest.
    match_queries / query_tokens / hit_tokens / kv_hit_tokens: over touching `match_prefix` calls (tokens
    asked for, reusable tokens found, KV-only tokens found); hit_rate = hit_tokens / query_tokens.
    inserted_pages / duplicate_pages / evicted_pages / evicted_snapshots: cumulative. Survive `reset`.
    """

    pages: int
    snapshots: int
    nodes: int
    locked_pages: int
    evictable_pages: int
    match_queries: int
    query_tokens: int
    hit_tokens: int
    kv_hit_tokens: int
    hit_rate: float
    inserted_pages: int
    duplicate_pages: int
    evicted_pages: int
    evicted_snapshots: int


class RadixCache:
    """Radix tree over token ids, page-aligned, one tree per namespace (see the package docstring).

    Args:
        page_size: tokens per KV page (>= 1); every cached length is a multiple of it.
        has_gdn: the model has GDN layers; a hit then needs a snapshot at exactly the hit position.
        snapshot_cost_tokens: memory of one GDN snapshot expressed in tokens of KV (eviction weighting);
            6144 matches Qwen3.5-397B (fp32 state ~184 MiB vs ~30 KiB of bf16 KV per token).
        alpha: weight of the saving-per-memory term against recency in the eviction score; 0 = pure LRU.
    Raises ValueError for page_size < 1, snapshot_cost_tokens <= 0 or alpha < 0.
    """

    def __init__(self, page_size: int, has_gdn: bool = True, snapshot_cost_tokens: int = 6144,
                 alpha: float = 1.0) -> None:
        if page_size < 1 or snapshot_cost_tokens <= 0 or alpha < 0:
            raise ValueError(f"bad RadixCache arguments: page_size={page_size}, "
                             f"snapshot_cost_tokens={snapshot_cost_tokens}, alpha={alpha}")
        self.page_size = page_size
        self.has_gdn = has_gdn
        self.snapshot_cost_tokens = snapshot_cost_tokens
        self.alpha = alpha
        self._roots: dict[Hashable, TreeNode] = {}
        self._pages: set[int] = set()
        self._snapshots: dict[int, TreeNode] = {}  # snapshot id -> the node holding it (splits keep it)
        self._locked_pages = 0
        self._clock = 0
        self._seq = itertools.count()  # heap tie-breaker: deterministic, never compares nodes
        self._counters = dict(match_queries=0, query_tokens=0, hit_tokens=0, kv_hit_tokens=0,
                              inserted_pages=0, duplicate_pages=0, evicted_pages=0, evicted_snapshots=0)

    # ----------------------------------------------------------------------------------------- queries
    @property
    def num_pages(self) -> int:
        """KV pages the tree owns."""
        return len(self._pages)

    @property
    def num_snapshots(self) -> int:
        """GDN snapshots the tree owns."""
        return len(self._snapshots)

    @property
    def evictable_pages(self) -> int:
        """Pages not on a locked path: `evict_pages` can free all of them."""
        return len(self._pages) - self._locked_pages

    def counters(self) -> dict[str, int]:
        """A copy of the event counters (match_queries, query_tokens, hit_tokens, kv_hit_tokens, inserted_pages,
        duplicate_pages, evicted_pages, evicted_snapshots), O(1): safe to read from another thread."""
        return dict(self._counters)

    def stats(self) -> CacheStats:
        """Current counters (walks the tree for the node count: O(nodes))."""
        c = self._counters
        nodes = sum(1 for _ in self._nodes())
        return CacheStats(pages=len(self._pages), snapshots=len(self._snapshots), nodes=nodes,
                          locked_pages=self._locked_pages, evictable_pages=self.evictable_pages,
                          hit_rate=c["hit_tokens"] / c["query_tokens"] if c["query_tokens"] else 0.0, **c)

    def match_prefix(self, tokens: Sequence[int], namespace: Hashable = None, touch: bool = True) -> MatchResult:
        """Longest reusable cached prefix of `tokens` (see `MatchResult`).

        Only whole pages of `tokens` are matched. A caller that needs the logits of the last prompt token
        passes ``tokens[:-1]`` so at least one token is left to prefill. With ``touch=True`` (admission) the
        matched nodes become most recently used, the statistics count the query and, without GDN, an edge
        matched part-way is split so `node` ends exactly at `length`. ``touch=False`` (e.g. ordering the
        queue by longest prefix) changes nothing; its `node` may then end past `length` (locking it is still
        safe, it protects a little more).
        """
        key = tuple(tokens)
        root = self._root(namespace)
        path, partial, m = self._descend(root, key)
        kv_length = path[-1].depth + m * self.page_size
        if self.has_gdn:
            target = next((n for n in reversed(path) if n.snapshot is not None), root)
            length, node = target.depth, target
        elif partial is not None and touch:
            node = self._split(partial, m * self.page_size)
            path.append(node)
            length = node.depth
        else:
            length, node = kv_length, partial if partial is not None else path[-1]
        pages: list[int] = []
        for n in path[1:]:
            if n.depth > length:
                break
            pages.extend(n.pages)
        if len(pages) < length // self.page_size:  # unsplit partial edge (touch=False, no GDN)
            pages.extend(node.pages[: length // self.page_size - len(pages)])
        if touch:
            self._touch(path)
            c = self._counters
            c["match_queries"] += 1
            c["query_tokens"] += len(key)
            c["hit_tokens"] += length
            c["kv_hit_tokens"] += kv_length
        return MatchResult(length=length, pages=pages, snapshot=node.snapshot if length else None, node=node,
                           kv_length=kv_length)

    # ------------------------------------------------------------------------------------------- locks
    def lock(self, node: TreeNode) -> None:
        """Protect `node` and its ancestors from eviction, and `node`'s own snapshot (counts nest).

        Raises ValueError if `node` is no longer in the tree (evicted or reset since it was returned).
        """
        self._require_attached(node)
        for n in node.path_to_root():
            if n.lock_ref == 0:
                self._locked_pages += len(n.pages)
            n.lock_ref += 1
        node.direct_lock += 1

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`. Raises RuntimeError if `node` holds no lock."""
        if node.direct_lock <= 0:
            raise RuntimeError("unlock of a node that is not locked")
        node.direct_lock -= 1
        for n in node.path_to_root():
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._locked_pages -= len(n.pages)

    # ----------------------------------------------------------------------------------------- updates
    def insert(self, tokens: Sequence[int], pages: Sequence[int], namespace: Hashable = None) -> InsertResult:
        """Cache the first ``len(pages) * page_size`` tokens of `tokens` with their KV page ids.

        ``len(pages)`` must equal ``len(tokens) // page_size`` (a trailing partial page is not cached; its
        page stays the caller's). Ownership: see `InsertResult.duplicates`. Splits an edge where the new
        path leaves it (at a page boundary; snapshots keep their node and depth). Raises ValueError, leaving
        the tree unchanged, when the page count is wrong, an id repeats, or an id the tree owns appears at a
        position where the tree holds a different id.
        """
        ps = self.page_size
        if len(pages) != len(tokens) // ps:
            raise ValueError(f"insert: {len(pages)} pages for {len(tokens)} tokens at page_size {ps}")
        if len(set(pages)) != len(pages):
            raise ValueError("insert: a page id appears twice")
        key = tuple(tokens[: len(pages) * ps])
        root = self._root(namespace)
        path, partial, m = self._descend(root, key)
        held = [p for n in path[1:] for p in n.pages] + (partial.pages[:m] if partial is not None else [])
        for i, p in enumerate(pages):
            if p in self._pages and (i >= len(held) or held[i] != p):
                raise ValueError(f"insert: page {p} is already owned by the tree at another position")
        if partial is not None:
            path.append(self._split(partial, m * ps))
        node = path[-1]
        new = list(pages[len(held):])
        if new:
            leaf = TreeNode(key=key[len(held) * ps:], pages=new, parent=node, depth=len(key), namespace=namespace)
            node.children[leaf.key[:ps]] = leaf
            self._pages.update(new)
            path.append(leaf)
            node = leaf
        self._touch(path)
        duplicates = [p for p, h in zip(pages, held, strict=False) if p != h]
        self._counters["inserted_pages"] += len(new)
        self._counters["duplicate_pages"] += len(duplicates)
        return InsertResult(node=node, duplicates=duplicates, new_pages=len(new))

    def set_snapshot(self, tokens: Sequence[int], snapshot_id: int, namespace: Hashable = None) -> int | None:
        """Attach `snapshot_id` = the exact GDN state after all of `tokens` (a cached, page-aligned prefix).

        The tree takes ownership of `snapshot_id` and returns the id the caller must free, if any: the
        snapshot it replaces at that position, or `snapshot_id` itself when the KV path for `tokens` is not
        (or no longer) fully cached, in which case nothing changes. An edge is split when the position falls
        inside it. Raises ValueError when has_gdn is False, ``len(tokens)`` is 0 or not a multiple of
        page_size, or `snapshot_id` is already held at another position.
        """
        ps = self.page_size
        if not self.has_gdn or not tokens or len(tokens) % ps:
            raise ValueError(f"set_snapshot: needs has_gdn and a page-aligned length > 0, got {len(tokens)}")
        key = tuple(tokens)
        path, partial, m = self._descend(self._root(namespace), key)
        if path[-1].depth + m * ps < len(key):
            if snapshot_id in self._snapshots:
                raise ValueError(f"set_snapshot: snapshot {snapshot_id} is already held elsewhere")
            return snapshot_id
        if partial is not None:
            path.append(self._split(partial, m * ps))
        node = path[-1]
        if node.snapshot == snapshot_id:
            self._touch(path)
            return None
        if snapshot_id in self._snapshots:
            raise ValueError(f"set_snapshot: snapshot {snapshot_id} is already held elsewhere")
        old = node.snapshot
        node.snapshot = snapshot_id
        self._snapshots[snapshot_id] = node
        if old is not None:
            del self._snapshots[old]
        self._touch(path)
        return old

    def drop_snapshot(self, tokens: Sequence[int], snapshot_id: int, namespace: Hashable = None) -> bool:
        """Remove `snapshot_id` from the node ending at ``len(tokens)`` (the caller then frees it).

        Used by a host tier to bound its own memory. Returns False (nothing changes) when that node does not
        hold `snapshot_id` or is locked directly (a running request is about to copy it).
        """
        key = tuple(tokens)
        path, partial, _ = self._descend(self._root(namespace), key)
        node = path[-1]
        if partial is not None or node.depth != len(key) or node.snapshot != snapshot_id or node.direct_lock:
            return False
        node.snapshot = None
        del self._snapshots[snapshot_id]
        self._counters["evicted_snapshots"] += 1
        return True

    # ---------------------------------------------------------------------------------------- eviction
    def evict_pages(self, n: int) -> Freed:
        """Evict whole unlocked leaves until at least `n` pages are freed or none is evictable.

        Leaves go in score order (package docstring): with GDN, leaves without a snapshot (KV no hit can
        use) first, LRU among them. An evicted leaf's snapshot is freed with it (a snapshot is unusable
        without the KV under it); a parent left childless becomes a candidate. May free more than `n`.
        """
        freed = Freed()
        if n <= 0:
            return freed
        lo, hi = self._clock_range()
        heap: list[tuple[int, float, int, TreeNode]] = []
        for node in self._nodes():
            if self._page_candidate(node):
                heapq.heappush(heap, self._page_entry(node, lo, hi))
        while heap and len(freed.pages) < n:
            node = heapq.heappop(heap)[3]
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[: self.page_size]]
            node.parent = None  # detached: lock() refuses it from now on
            freed.pages.extend(node.pages)
            self._pages.difference_update(node.pages)
            if node.snapshot is not None:
                freed.snapshots.append(node.snapshot)
                del self._snapshots[node.snapshot]
            if self._page_candidate(parent):
                heapq.heappush(heap, self._page_entry(parent, lo, hi))
        self._counters["evicted_pages"] += len(freed.pages)
        self._counters["evicted_snapshots"] += len(freed.snapshots)
        return freed

    def evict_snapshots(self, n: int, only: Callable[[int], bool] | None = None) -> Freed:
        """Drop up to `n` snapshots (KV pages stay), lowest score first; never one on a node locked directly.

        `only`, when given, limits eviction to snapshot ids it accepts (e.g. those in one memory tier).
        Dropping a snapshot raises the value of the snapshots below it (their hits no longer fall back to
        it), so scores are re-checked lazily when popped.
        """
        freed = Freed()
        if n <= 0:
            return freed
        # Candidates from the id -> node map, not a walk of the tree: the scheduler calls this whenever a
        # snapshot slot is short, often with every slot held by running requests (no candidate at all).
        candidates = [node for sid, node in self._snapshots.items()
                      if node.direct_lock == 0 and (only is None or only(sid))]
        if not candidates:
            return freed
        lo, hi = self._clock_range()
        heap = [(self._snapshot_score(node, lo, hi), next(self._seq), node) for node in candidates]
        heapq.heapify(heap)
        while heap and len(freed.snapshots) < n:
            s, key, node = heapq.heappop(heap)
            fresh = self._snapshot_score(node, lo, hi)
            if fresh > s + 1e-12:
                heapq.heappush(heap, (fresh, key, node))
                continue
            assert node.snapshot is not None
            freed.snapshots.append(node.snapshot)
            del self._snapshots[node.snapshot]
            node.snapshot = None
        self._counters["evicted_snapshots"] += len(freed.snapshots)
        return freed

    def reset(self) -> Freed:
        """Empty the tree and return every page id and snapshot id it owned. Statistics are kept.

        Raises RuntimeError while any node is locked (a running request still reads the cache).
        """
        if any(r.lock_ref for r in self._roots.values()):
            raise RuntimeError("reset of a RadixCache with locked nodes")
        freed = Freed(pages=sorted(self._pages), snapshots=sorted(self._snapshots))
        for root in self._roots.values():
            for node in self._subtree(root):
                node.parent = None
        self._roots.clear()
        self._pages.clear()
        self._snapshots.clear()
        return freed

    def check_invariants(self) -> None:
        """Verify the tree's structure and bookkeeping (tests, debugging). Raises AssertionError on a fault."""
        ps, pages, snaps, locked = self.page_size, [], [], 0

        def fail(msg: str) -> None:
            raise AssertionError(f"RadixCache invariant: {msg}")

        for ns, root in self._roots.items():
            if root.key or root.pages or root.depth or root.snapshot is not None or root.parent is not None:
                fail("root carries data")
            for node in self._subtree(root):
                if node.lock_ref != node.direct_lock + sum(c.lock_ref for c in node.children.values()):
                    fail("lock_ref is not direct locks plus children's")
                if node.namespace != ns:
                    fail("node in the wrong namespace")
                for first, child in node.children.items():
                    if child.parent is not node or child.key[:ps] != first:
                        fail("child link or child key broken")
                if node is root:
                    continue
                if not node.key or len(node.key) % ps or len(node.pages) != len(node.key) // ps:
                    fail("edge not page-aligned or page count wrong")
                assert node.parent is not None
                if node.depth != node.parent.depth + len(node.key):
                    fail("depth mismatch")
                pages.extend(node.pages)
                locked += len(node.pages) if node.lock_ref else 0
                if node.snapshot is not None:
                    if not self.has_gdn or node.depth % ps:
                        fail("snapshot without GDN or off a page boundary")
                    snaps.append(node.snapshot)
        if len(pages) != len(set(pages)) or set(pages) != self._pages:
            fail("page ids duplicated or out of sync")
        if len(snaps) != len(set(snaps)) or set(snaps) != set(self._snapshots):
            fail("snapshot ids duplicated or out of sync")
        if any(node.snapshot != sid for sid, node in self._snapshots.items()):
            fail("snapshot id mapped to a node that does not hold it")
        if locked != self._locked_pages:
            fail("locked page count out of sync")

    # ---------------------------------------------------------------------------------------- internals
    def _root(self, namespace: Hashable) -> TreeNode:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = TreeNode(key=(), pages=[], parent=None, depth=0, namespace=namespace)
        return root

    def _descend(self, root: TreeNode, key: tuple[int, ...]) -> tuple[list[TreeNode], TreeNode | None, int]:
        """Nodes fully matched by `key` (root first), then the child matched part-way and its matched pages."""
        ps = self.page_size
        end = len(key) // ps * ps
        path, node, pos = [root], root, 0
        while pos < end:
            child = node.children.get(key[pos: pos + ps])
            if child is None:
                break
            m = 1  # the first page matched through the children dict
            limit = min(len(child.key), end - pos) // ps
            while m < limit and child.key[m * ps: (m + 1) * ps] == key[pos + m * ps: pos + (m + 1) * ps]:
                m += 1
            if m * ps < len(child.key):
                return path, child, m
            path.append(child)
            node, pos = child, pos + len(child.key)
        return path, None, 0

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Split `node`'s edge `at` tokens (page-aligned, inside the edge) below its parent; returns the new
        upper node. The lower part keeps its depth, snapshot and direct locks, so a snapshot keeps its meaning;
        the upper part inherits the path lock count (every lock below it passes through it)."""
        ps, parent = self.page_size, node.parent
        assert parent is not None and 0 < at < len(node.key) and at % ps == 0
        mid = TreeNode(key=node.key[:at], pages=node.pages[: at // ps], parent=parent,
                       depth=node.depth - len(node.key) + at, namespace=node.namespace,
                       lock_ref=node.lock_ref, last_access=node.last_access)
        parent.children[mid.key[:ps]] = mid
        node.key, node.pages, node.parent = node.key[at:], node.pages[at // ps:], mid
        mid.children[node.key[:ps]] = node
        return mid

    def _touch(self, path: list[TreeNode]) -> None:
        self._clock += 1
        for n in path:
            n.last_access = self._clock

    def _require_attached(self, node: TreeNode) -> None:
        top = node.path_to_root()[-1]
        if self._roots.get(top.namespace) is not top:
            raise ValueError("node is no longer in the cache (evicted or reset)")

    def _nodes(self) -> Iterator[TreeNode]:
        for root in list(self._roots.values()):
            yield from self._subtree(root)

    @staticmethod
    def _subtree(root: TreeNode) -> Iterator[TreeNode]:
        stack = [root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _clock_range(self) -> tuple[int, int]:
        stamps = [n.last_access for n in self._nodes() if not n.is_root]
        return (min(stamps), max(stamps)) if stamps else (0, 0)

    @staticmethod
    def _page_candidate(node: TreeNode) -> bool:
        return not node.is_root and not node.children and node.lock_ref == 0

    def _page_entry(self, node: TreeNode, lo: int, hi: int) -> tuple[int, float, int, TreeNode]:
        saving = page_saving_tokens(node, self.has_gdn)
        cost = len(node.key) + (self.snapshot_cost_tokens if node.snapshot is not None else 0)
        tier = 0 if self.has_gdn and saving == 0 else 1
        return tier, score(node.last_access, lo, hi, saving, cost, self.alpha), next(self._seq), node

    def _snapshot_score(self, node: TreeNode, lo: int, hi: int) -> float:
        return score(node.last_access, lo, hi, snapshot_saving_tokens(node), self.snapshot_cost_tokens, self.alpha)
