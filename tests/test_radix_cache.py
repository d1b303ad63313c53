"""RadixCache: seeded random operation sequences against a brute-force model, plus targeted cases.

The model keeps, per namespace, a dict {page-aligned prefix (tuple): page id} and {prefix: snapshot id};
the tree must agree with it on every match, every ownership hand-over and every eviction.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from sglang_tpu_qwen.radix_cache import RadixCache


class Model:
    """Brute force: every cached page position and snapshot, keyed by (namespace, prefix tokens)."""

    def __init__(self, page_size: int, has_gdn: bool) -> None:
        self.ps, self.has_gdn = page_size, has_gdn
        self.pages: dict[tuple, int] = {}  # (ns, prefix) -> id of the page ending the prefix
        self.snaps: dict[tuple, int] = {}  # (ns, prefix) -> snapshot id

    def kv_len(self, ns, toks: tuple) -> int:
        n = 0
        while n + self.ps <= len(toks) and (ns, toks[: n + self.ps]) in self.pages:
            n += self.ps
        return n

    def match(self, ns, toks: tuple) -> tuple[int, list[int], int | None, int]:
        kv = self.kv_len(ns, toks)
        length = kv
        if self.has_gdn:
            length = max([p for p in range(self.ps, kv + 1, self.ps) if (ns, toks[:p]) in self.snaps], default=0)
        pages = [self.pages[(ns, toks[:p])] for p in range(self.ps, length + 1, self.ps)]
        return length, pages, self.snaps.get((ns, toks[:length])) if length else None, kv


def _check_against(cache: RadixCache, model: Model, probes: list[tuple]) -> None:
    cache.check_invariants()
    assert cache.num_pages == len(model.pages) and cache.num_snapshots == len(model.snaps)
    for ns, toks in probes:
        m = cache.match_prefix(toks, ns, touch=False)
        assert (m.length, m.pages, m.snapshot, m.kv_length) == model.match(ns, toks)


@pytest.mark.parametrize("has_gdn", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_brute_force_model(seed: int, has_gdn: bool) -> None:
    rng = random.Random(seed)
    ps = rng.choice([1, 2, 4])
    cache, model = RadixCache(ps, has_gdn=has_gdn, snapshot_cost_tokens=rng.choice([2, 64]),
                              alpha=rng.choice([0.0, 1.0])), Model(ps, has_gdn)
    bases = [tuple(rng.randrange(3) for _ in range(24)) for _ in range(3)]
    next_id = iter(range(1, 10**6))
    caller_pages: set[int] = set()  # ids the caller owns (allocated, not held by the tree)
    locks: list[tuple] = []  # (node, ns, prefix tokens of length m.length)
    probes: list[tuple] = []

    def seq() -> tuple:
        return rng.choice(bases)[: rng.randrange(0, 25)] + tuple(rng.randrange(3) for _ in range(rng.randrange(6)))

    for _ in range(250):
        ns = rng.choice([None, None, "b"])
        op = rng.random()
        toks = seq()
        probes = (probes + [(ns, toks)])[-12:]
        if op < 0.3:  # insert: reuse the tree's id at half of the cached positions, fresh ids elsewhere
            n = len(toks) // ps
            pages, expect_dup = [], []
            for i in range(n):
                held = model.pages.get((ns, toks[: (i + 1) * ps]))
                if held is not None and rng.random() < 0.5:
                    pages.append(held)
                else:
                    p = next(next_id)
                    pages.append(p)
                    caller_pages.add(p)
                    if held is not None:
                        expect_dup.append(p)
            r = cache.insert(toks, pages, ns)
            assert r.duplicates == expect_dup and r.node.depth == n * ps
            assert r.new_pages == sum((ns, toks[: (i + 1) * ps]) not in model.pages for i in range(n))
            for i, p in enumerate(pages):
                key = (ns, toks[: (i + 1) * ps])
                if key not in model.pages:
                    model.pages[key] = p
                    caller_pages.discard(p)
            caller_pages.difference_update(expect_dup)  # the caller frees its duplicates
        elif op < 0.45 and has_gdn and len(toks) >= ps:
            pos = rng.randrange(1, len(toks) // ps + 1) * ps
            sid = next(next_id)
            back = cache.set_snapshot(toks[:pos], sid, ns)
            if model.kv_len(ns, toks[:pos]) == pos:
                assert back == model.snaps.get((ns, toks[:pos]))
                model.snaps[(ns, toks[:pos])] = sid
            else:
                assert back == sid
        elif op < 0.6:
            m = cache.match_prefix(toks, ns)
            assert (m.length, m.pages, m.snapshot, m.kv_length) == model.match(ns, toks)
            assert m.node.depth == m.length
            if rng.random() < 0.6:
                cache.lock(m.node)
                locks.append((m.node, ns, toks[: m.length]))
        elif op < 0.7 and locks:
            node, _, _ = locks.pop(rng.randrange(len(locks)))
            cache.unlock(node)
        elif op < 0.85:
            want = rng.randrange(1, 8)
            protected = {(lns, lt[:p]) for _, lns, lt in locks for p in range(ps, len(lt) + 1, ps)}
            evictable = len(model.pages) - len(protected)
            freed = cache.evict_pages(want)
            assert len(freed.pages) >= min(want, evictable) and len(freed.pages) <= evictable
            inv = {v: k for k, v in model.pages.items()}
            gone = {inv[p] for p in freed.pages}
            assert not gone & protected
            for k in gone:
                del model.pages[k]
            for (kns, kt) in gone:  # only whole subtrees go: nothing cached below an evicted position
                assert not any(ons == kns and len(ot) > len(kt) and ot[: len(kt)] == kt for ons, ot in model.pages)
            lost = sorted(model.snaps.pop(k) for k in list(model.snaps) if k in gone)
            assert sorted(freed.snapshots) == lost
        elif has_gdn:
            want = rng.randrange(1, 4)
            direct = {(lns, lt) for _, lns, lt in locks}
            evictable = sum(k not in direct for k in model.snaps)
            freed = cache.evict_snapshots(want)
            assert freed.pages == [] and len(freed.snapshots) == min(want, evictable)
            inv = {v: k for k, v in model.snaps.items()}
            for s in freed.snapshots:
                assert inv[s] not in direct
                del model.snaps[inv[s]]
        for _node, lns, lt in locks:  # a locked path keeps its pages and its snapshot
            assert cache.match_prefix(lt, lns, touch=False).length == len(lt)
        _check_against(cache, model, probes)

    if locks:
        with pytest.raises(RuntimeError):
            cache.reset()
    for node, _, _ in locks:
        cache.unlock(node)
    held_pages, held_snaps = set(model.pages.values()), set(model.snaps.values())
    freed = cache.reset()
    assert sorted(freed.pages) == sorted(held_pages) and sorted(freed.snapshots) == sorted(held_snaps)
    assert not caller_pages & held_pages  # every id was held by exactly one side
    assert cache.num_pages == 0 and cache.num_snapshots == 0 and cache.stats().nodes == 0
    cache.check_invariants()


def test_import_does_not_load_jax() -> None:
    code = "import sys, sglang_tpu_qwen.radix_cache; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_namespaces_never_share() -> None:
    cache = RadixCache(2)
    toks = list(range(8))
    cache.insert(toks, [1, 2, 3, 4], namespace="a")
    assert cache.set_snapshot(toks, 100, namespace="a") is None
    miss = cache.match_prefix(toks, namespace="b")
    assert (miss.length, miss.kv_length, miss.pages, miss.snapshot) == (0, 0, [], None)
    r = cache.insert(toks, [5, 6, 7, 8], namespace="b")
    assert r.duplicates == [] and r.new_pages == 4  # b's pages are not duplicates of a's
    assert cache.match_prefix(toks, namespace="b").length == 0  # no snapshot in b yet
    hit = cache.match_prefix(toks, namespace="a")
    assert (hit.length, hit.pages, hit.snapshot) == (8, [1, 2, 3, 4], 100)
    cache.check_invariants()


def test_insert_ownership_duplicates_and_errors() -> None:
    cache = RadixCache(4, has_gdn=False)
    toks = list(range(12))
    assert cache.insert(toks + [99], [1, 2, 3]).new_pages == 3  # the partial tail page is ignored
    r = cache.insert(toks + [7, 7, 7, 7], [1, 20, 30, 40])  # page 1 reused, 20 and 30 duplicate, 40 new
    assert r.duplicates == [20, 30] and r.new_pages == 1 and r.node.depth == 16
    assert cache.match_prefix(toks + [7, 7, 7, 7]).pages == [1, 2, 3, 40]
    before = cache.stats()
    with pytest.raises(ValueError):  # page 2 is the tree's, at another position
        cache.insert([5] * 8, [50, 2])
    with pytest.raises(ValueError):
        cache.insert(toks, [1, 2])
    with pytest.raises(ValueError):
        cache.insert([5] * 8, [60, 60])
    assert cache.stats() == before
    cache.check_invariants()


def test_split_keeps_snapshot_meaning_and_locks() -> None:
    cache = RadixCache(2)
    a = [1, 1, 2, 2, 3, 3, 4, 4]
    cache.insert(a, [10, 11, 12, 13])
    assert cache.set_snapshot(a, 500) is None
    m = cache.match_prefix(a)
    cache.lock(m.node)
    # A snapshot in the middle of the edge splits it; the old one still means "after 8 tokens".
    assert cache.set_snapshot(a[:4], 501) is None
    # A branch at token 6 splits again below it.
    b = a[:6] + [9, 9]
    r = cache.insert(b, [10, 11, 12, 20])
    assert r.duplicates == [] and r.new_pages == 1
    assert cache.stats().nodes == 1 + 4  # root, [0,4), [4,6), [6,8) of a, [6,8) of b
    full = cache.match_prefix(a)
    assert (full.length, full.pages, full.snapshot, full.node) == (8, [10, 11, 12, 13], 500, m.node)
    part = cache.match_prefix(b)
    assert (part.length, part.pages, part.snapshot, part.kv_length) == (4, [10, 11], 501, 8)
    assert cache.set_snapshot(a[:4], 502) == 501  # replacement hands the old id back
    assert cache.set_snapshot([7, 7], 503) == 503  # path not cached: not adopted
    # The lock on a's leaf protects its whole path (split nodes inherited the count) and its snapshot.
    freed = cache.evict_pages(100)
    assert freed.pages == [20] and freed.snapshots == []
    assert cache.evict_snapshots(10).snapshots == [502]
    cache.check_invariants()
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(m.node)
    with pytest.raises(RuntimeError):
        cache.unlock(m.node)
    freed = cache.reset()
    assert sorted(freed.pages) == [10, 11, 12, 13] and freed.snapshots == [500]
    with pytest.raises(ValueError):
        cache.lock(m.node)  # a handle from before the reset


def test_gdn_match_needs_snapshot_and_kv_length_marks_branch() -> None:
    cache = RadixCache(4)
    sys_prompt, q = list(range(100, 116)), [1, 2, 3, 4]
    cache.insert(sys_prompt + q, [1, 2, 3, 4, 5])
    m = cache.match_prefix(sys_prompt + [9, 9, 9, 9, 9])
    assert (m.length, m.snapshot, m.kv_length) == (0, None, 16)  # KV but no state: no hit
    assert cache.set_snapshot(sys_prompt[: m.kv_length], 7) is None  # the branch-point snapshot
    m = cache.match_prefix(sys_prompt + [9, 9, 9, 9, 9])
    assert (m.length, m.pages, m.snapshot) == (16, [1, 2, 3, 4], 7)
    with pytest.raises(ValueError):
        cache.set_snapshot(sys_prompt[:6], 8)  # not page-aligned
    with pytest.raises(ValueError):
        cache.set_snapshot(sys_prompt[:8], 7)  # id already held elsewhere
    with pytest.raises(ValueError):
        RadixCache(4, has_gdn=False).set_snapshot(sys_prompt[:4], 1)


def test_no_gdn_match_splits_so_node_ends_at_length() -> None:
    cache = RadixCache(2, has_gdn=False)
    cache.insert([1, 2, 3, 4, 5, 6], [1, 2, 3])
    probe = cache.match_prefix([1, 2, 3, 4, 0, 0], touch=False)
    assert (probe.length, probe.pages, probe.node.depth) == (4, [1, 2], 6) and cache.stats().nodes == 2
    m = cache.match_prefix([1, 2, 3, 4, 0, 0])
    assert (m.length, m.pages, m.node.depth) == (4, [1, 2], 4) and cache.stats().nodes == 3
    cache.lock(m.node)
    assert cache.evictable_pages == 1 and cache.evict_pages(5).pages == [3]
    cache.unlock(m.node)
    s = cache.stats()
    assert (s.match_queries, s.query_tokens, s.hit_tokens, s.hit_rate) == (1, 6, 4, 4 / 6)


def _two_prefixes(alpha: float) -> RadixCache:
    """An old locked node stretches the clock range, so long_p (older) and short_p (newest) differ little in
    recency: long_p saves 40 tokens for 42 tokens of memory, short_p 2 for 4."""
    cache = RadixCache(2, snapshot_cost_tokens=2, alpha=alpha)
    cache.lock(cache.insert([9, 9], [900]).node)
    for _ in range(20):
        cache.match_prefix([8, 8])  # misses advance the clock
    cache.insert([1] * 40, list(range(100, 120)))
    cache.set_snapshot([1] * 40, 1)
    cache.insert([2] * 2, [200])
    cache.set_snapshot([2] * 2, 2)
    return cache


def test_eviction_order_dead_kv_first_then_saving_over_recency() -> None:
    cache = _two_prefixes(alpha=1.0)
    cache.insert([3] * 4, [300, 301])  # most recent, but no snapshot: no hit can use it
    assert cache.evict_pages(1).pages == [300, 301]
    freed = cache.evict_pages(1)  # the newer short prefix goes: it saves far less per byte
    assert freed.pages == [200] and freed.snapshots == [2]
    lru = _two_prefixes(alpha=0.0)  # pure LRU evicts the older long prefix
    freed = lru.evict_pages(1)
    assert freed.pages == list(range(100, 120)) and freed.snapshots == [1]
    assert lru.evict_pages(10).pages == [200]  # the locked node stays
    assert lru.num_pages == 1


def test_snapshot_eviction_prefers_small_marginal_saving() -> None:
    cache = RadixCache(4, snapshot_cost_tokens=4, alpha=1.0)
    toks = list(range(64))
    cache.insert(toks, list(range(1, 17)))
    cache.set_snapshot(toks[:4], 10)  # oldest: saves 4 tokens over the root
    cache.set_snapshot(toks[:60], 11)  # saves 56 over the one at 4
    cache.set_snapshot(toks, 12)  # newest, but saves only 4 over the one at 60
    assert cache.evict_snapshots(1).snapshots == [10]
    # With 10 gone, 11 now saves 60 (re-scored lazily); 12 still saves only 4.
    assert cache.evict_snapshots(1).snapshots == [12]
    assert cache.match_prefix(toks).length == 60


def test_snapshot_eviction_rescores_after_an_ancestor_goes() -> None:
    # alpha large: the saving term decides. Savings before any eviction: a=4, b=8 (over a), c=10; once a is
    # gone b saves 12 and must outlive c, which a stale score (8) would not.
    cache = RadixCache(2, snapshot_cost_tokens=4, alpha=100.0)
    path_b, path_c = [1] * 12, [2] * 10
    cache.insert(path_b, list(range(10, 16)))
    cache.insert(path_c, list(range(20, 25)))
    assert cache.set_snapshot(path_b[:4], 1) is None
    assert cache.set_snapshot(path_b, 2) is None
    assert cache.set_snapshot(path_c, 3) is None
    assert cache.evict_snapshots(2).snapshots == [1, 3]
    assert cache.match_prefix(path_b).snapshot == 2


def test_drop_snapshot_only_exact_unlocked() -> None:
    cache = RadixCache(page_size=2)
    toks = [1, 2, 3, 4, 5, 6]
    cache.insert(toks, [10, 11, 12])
    assert cache.set_snapshot(toks[:4], 7) is None
    assert not cache.drop_snapshot(toks[:4], 8)  # another id
    assert not cache.drop_snapshot(toks[:2], 7)  # another position
    m = cache.match_prefix(toks[:5])
    assert (m.length, m.snapshot) == (4, 7)
    cache.lock(m.node)
    assert not cache.drop_snapshot(toks[:4], 7)  # locked directly: a request is copying it
    cache.unlock(m.node)
    assert cache.drop_snapshot(toks[:4], 7)
    assert cache.num_snapshots == 0 and cache.match_prefix(toks[:5]).length == 0
    cache.check_invariants()


def test_evict_snapshots_only_filter() -> None:
    cache = RadixCache(page_size=2)
    toks = [1, 2, 3, 4, 5, 6]
    cache.insert(toks, [10, 11, 12])
    cache.set_snapshot(toks[:2], 100)
    cache.set_snapshot(toks[:4], 7)
    freed = cache.evict_snapshots(5, only=lambda sid: sid < 50)
    assert freed.snapshots == [7] and cache.num_snapshots == 1
    cache.check_invariants()
