"""PrefixCache: the scheduler's side of prefix reuse, joining the radix tree to device memory.

The radix tree (`sglang_tpu_qwen.radix_cache`, pure Python) records which KV pages and which GDN
snapshots hold which prefix. This class moves the bytes: it copies a snapshot into a request's running
slot on a hit, copies a running slot into a snapshot slot when a snapshot is taken, demotes evicted
snapshots to the host tier and brings them back, and returns every page and slot the tree gives up.

Where snapshots are taken (Marconi, Pan et al., MLSys 2025, adapted to page-aligned KV):
- at every prefill chunk that ends on a page boundary: the prompt's last page boundary before its final
  token (so a resend of the same prompt hits there), the branch point where a request leaves a cached
  path (`kv_length` of the match), and plain chunked-prefill boundaries. The scheduler ends prefill
  chunks at the first two on purpose (`next_target`), costing one extra short step each;
- during decode, at each page boundary, into one private snapshot slot per request (overwritten in
  place); when the request finishes (or is retracted) that snapshot joins the tree with the pages of
  prompt + output, so the next turn of a conversation hits at the end of this turn's reply.
Memory: one snapshot holds the GDN state of all GDN layers (Qwen3.5-397B: ~184 MiB in fp32, as much as
~6k tokens of KV), so snapshot slots have their own budget (--max-gdn-snapshots) and the tree evicts
them by prefill saved per byte plus recency; a private decode snapshot costs one slot per running request.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang_tpu_qwen.engine.io.request import Request
from sglang_tpu_qwen.engine.runner.model_runner import ModelRunner
from sglang_tpu_qwen.memory.host_snapshots import HostSnapshotStore, is_host_id
from sglang_tpu_qwen.memory.id_pool import IdPool
from sglang_tpu_qwen.radix_cache import RadixCache

logger = logging.getLogger(__name__)


class PrefixCache:
    """Radix tree + snapshot slots + host tier for one scheduler (one device group).

    Page ownership: `r.pages[: r.num_tree_pages]` belong to the tree (locked through `r.prefix_node`);
    the rest belong to the request. Every page and slot is held by exactly one of: a pool, the tree, a
    request.
    """

    def __init__(self, runner: ModelRunner, kv_pool: IdPool, page_size: int, host_bytes: int,
                 nan_fill: bool, slot_base: int = 0) -> None:
        """`kv_pool`: the pages of this device group (DP rank); `slot_base`: global id of the rank's first
        slot, its snapshot slots being [slot_base + num_running_slots, slot_base + num_slots)."""
        cfg = runner.config
        self.runner = runner
        self.kv_pool = kv_pool
        self.page_size = page_size
        # A hybrid model's tree needs a snapshot at a hit's position even when the memory rule left no
        # snapshot slots (engine/runner/memory_split.py): KV pages alone would skip the GDN state.
        self.has_gdn = cfg.num_gdn_layers > 0
        self.takes_snapshots = self.has_gdn and runner.sizing.num_snapshot_slots > 0
        # A snapshot's eviction cost in KV tokens of the same bytes, at the cache dtypes in use.
        units = runner.sizing.units
        cost = max(1, units.gdn_per_slot // max(units.kv_per_token, 1))
        self.tree = RadixCache(page_size, has_gdn=self.has_gdn, snapshot_cost_tokens=cost)
        sizing = runner.sizing
        self.snap_pool = (IdPool(slot_base + sizing.num_slots, "snapshot", start=slot_base + sizing.num_running_slots)
                          if self.takes_snapshots else None)
        self.host = HostSnapshotStore(host_bytes)
        self.nan_fill = nan_fill
        self._where: dict[int, tuple[int, ...]] = {}  # snapshot id in the tree -> its token prefix
        self.snapshot_hits = {"device": 0, "host": 0}  # admissions whose GDN state came from a snapshot

    # ---- admission -----------------------------------------------------------------------------
    def peek(self, r: Request) -> int:
        """Reusable prefix length of r now, without touching LRU state (for longest-prefix-first order)."""
        return self.tree.match_prefix(r.radix_ids[:-1], touch=False).length

    def admit(self, r: Request) -> None:
        """Match r's prefix, lock it, adopt its pages and restore its GDN state into r.slot."""
        # Leave >= 1 token: its logits pick the next token. Prompt logprobs from position s need the
        # hidden state at s - 1, so such a request may reuse at most s - 1 tokens.
        limit = len(r.fill_ids) - 1
        if r.return_logprob and not r.input_logprobs_done:
            limit = min(limit, max(0, r.logprob_start_len - 1))
        m = self.tree.match_prefix(r.radix_ids[:limit])
        self.tree.lock(m.node)
        r.prefix_node = m.node
        r.pages = list(m.pages)
        r.num_tree_pages = len(m.pages)
        r.cached_len = m.length
        if r.cached_tokens is None:
            r.cached_tokens = m.length
        if m.length and m.snapshot is not None:
            self._restore(m.snapshot, r.slot)
        logger.debug("admit %s: hit %d (kv %d) snapshot %s -> slot %s", r.rid[:6], m.length, m.kv_length,
                     m.snapshot, r.slot)
        targets = {self.page_size * ((len(r.fill_ids) - 1) // self.page_size)}
        if m.kv_length > m.length:
            targets.add(m.kv_length)
        r.snapshot_targets = sorted(t for t in targets if t > m.length)

    def next_target(self, r: Request) -> int | None:
        """First position past r.cached_len where a prefill chunk should end for a snapshot."""
        return next((t for t in r.snapshot_targets if t > r.cached_len), None)

    def _restore(self, snapshot: int, slot: int | None) -> None:
        """Copy a snapshot into a running slot: device -> device, or an upload from the host tier. Neither
        waits: the upload is dispatched while the previous step runs and the next step's forward follows it
        on the device."""
        assert slot is not None
        self.snapshot_hits["host" if is_host_id(snapshot) else "device"] += 1
        if is_host_id(snapshot):
            conv, rec = self.host.get(snapshot)
            self.runner.state.write_slot(slot, conv, rec)
        else:
            self.runner.state.copy_slots([(snapshot, slot)])

    # ---- after each step -----------------------------------------------------------------------
    def after_step(self, rows: list[Request], is_extend: bool) -> None:
        """Take the snapshots due after a step (rows' cached_len already advanced)."""
        self.host.settle()  # earlier demotions whose device->host copy is done keep only their host arrays
        ps = self.page_size
        due = [r for r in rows if r.cached_len % ps == 0 and r.cached_len > 0 and not r.finished]
        if not due:
            return
        if is_extend:
            for r in due:
                self._insert(r, r.cached_len)
            if self.takes_snapshots:
                taken = list(zip(due, self._alloc_snapshots(len(due)), strict=False))  # the first ones get slots
                # All allocations, then one copy, then the attaches: an attached snapshot could be evicted
                # (and demoted) by a later allocation before its copy; an unattached one cannot.
                self.runner.state.copy_slots([(r.slot, snap) for r, snap in taken])
                for r, snap in taken:
                    self._attach(r.radix_ids[: r.cached_len], snap)
        elif self.takes_snapshots:
            pairs = []
            fresh = iter(self._alloc_snapshots(sum(r.private_snapshot is None for r in due)))
            for r in due:
                if r.private_snapshot is None:
                    snap = next(fresh, None)
                    if snap is None:
                        continue
                    r.private_snapshot = (snap, 0)
                snap = r.private_snapshot[0]
                r.private_snapshot = (snap, r.cached_len)
                pairs.append((r.slot, snap))
            self.runner.state.copy_slots(pairs)

    def verify_snapshot_slot(self, r: Request) -> int:
        """The slot a verify step's commit writes r's decode snapshot to when r's accepted tokens reach a page
        boundary: r's private snapshot slot, taken now if r has none (0: no slot free, no snapshot)."""
        if not self.takes_snapshots:
            return 0
        if r.private_snapshot is None:
            fresh = self._alloc_snapshots(1)
            if not fresh:
                return 0
            r.private_snapshot = (fresh[0], 0)
        return r.private_snapshot[0]

    def verify_snapshot_taken(self, r: Request, position: int) -> None:
        """The verify step read: r's private snapshot now holds its state after `position` tokens (a page
        boundary), written by the step's commit (verify_snapshot_slot)."""
        self.host.settle()
        assert r.private_snapshot is not None and position % self.page_size == 0
        r.private_snapshot = (r.private_snapshot[0], position)
        r.snapshot_pending = False

    def _insert(self, r: Request, upto: int) -> None:
        """Give the tree r's pages for fill_ids[:upto] (page-aligned); r keeps reading them, locked."""
        n = upto // self.page_size
        if n <= r.num_tree_pages:
            return
        res = self.tree.insert(r.radix_ids[:upto], r.pages[:n])
        if res.duplicates:  # another request cached the same tokens first: use its pages, free ours
            self.kv_pool.free(res.duplicates)
        tree_pages = [p for node in reversed(res.node.path_to_root()) for p in node.pages]
        r.pages[:n] = tree_pages[:n]
        self.tree.lock(res.node)
        if r.prefix_node is not None:
            self.tree.unlock(r.prefix_node)
        r.prefix_node = res.node
        r.num_tree_pages = n

    def _attach(self, tokens: list[int], snap: int) -> None:
        key = tuple(tokens)
        returned = self.tree.set_snapshot(key, snap)
        logger.debug("attach snapshot %d at %d (returned %s)", snap, len(key), returned)
        if returned != snap:
            self._where[snap] = key
        if returned is not None:
            self._release_snapshots([returned], demote=False)

    # ---- leaving -------------------------------------------------------------------------------
    def finish(self, r: Request, keep: bool) -> None:
        """Request done or retracted: cache what it computed (keep=True), then drop its lock and snapshot.

        Afterwards r owns only r.pages[r.num_tree_pages:], which the caller frees.
        """
        if keep and r.slot is not None:
            upto = self.page_size * (r.cached_len // self.page_size)
            self._insert(r, upto)
            # A verify step in flight may have overwritten the snapshot with a state past what r keeps.
            if r.private_snapshot is not None and r.private_snapshot[1] > 0 and not r.snapshot_pending:
                snap, pos = r.private_snapshot
                r.private_snapshot = None
                self._attach(r.radix_ids[:pos], snap)
        if r.private_snapshot is not None:
            self._release_snapshots([r.private_snapshot[0]], demote=False)
            r.private_snapshot = None
        if r.prefix_node is not None:
            self.tree.unlock(r.prefix_node)
            r.prefix_node = None
        r.pages = r.pages[r.num_tree_pages:]
        r.num_tree_pages = 0
        r.snapshot_pending = False
        r.snapshot_targets = []

    # ---- memory pressure -----------------------------------------------------------------------
    def evict_pages(self, n: int) -> int:
        """Free at least n pages from unlocked tree leaves (fewer if not possible); returns pages freed."""
        freed = self.tree.evict_pages(n)
        self.kv_pool.free(freed.pages)
        self._release_snapshots(freed.snapshots, demote=False)
        return len(freed.pages)

    @property
    def evictable_pages(self) -> int:
        return self.tree.evictable_pages

    def _alloc_snapshots(self, n: int) -> list[int]:
        """Up to `n` free snapshot slots, evicting the tree's lowest-scored device snapshots for the shortfall.

        One eviction call for all of them: each call scores every candidate, and a step may need one slot per
        running request.
        """
        assert self.snap_pool is not None
        got: list[int] = []
        for _ in range(4):
            take = min(n - len(got), self.snap_pool.num_free)
            if take > 0:
                ids = self.snap_pool.alloc(take)
                assert ids is not None
                got.extend(ids)
            if len(got) == n:
                break
            # Only device snapshots: dropping a host one would free no slot here.
            freed = self.tree.evict_snapshots(n - len(got), only=lambda sid: not is_host_id(sid))
            if not freed.snapshots:
                break
            self._release_snapshots(freed.snapshots, demote=True)
        return got

    def _release_snapshots(self, ids: list[int], demote: bool) -> None:
        """Free snapshot ids the tree gave up (or never took); device ones may move to the host tier."""
        device = []
        for sid in ids:
            key = self._where.pop(sid, None)
            if is_host_id(sid):
                self.host.drop(sid)
                continue
            device.append(sid)
            if demote and key is not None:
                self._demote(sid, key)
        if device:
            assert self.snap_pool is not None
            self.snap_pool.free(device)
            if self.nan_fill:
                self.runner.state.fill_nan_slots(device)

    def _demote(self, sid: int, key: tuple[int, ...]) -> None:
        cache = self.runner.cache
        # One slot, all GDN layers, as the state pools' layout stores it (kernels/gdn/state_layout.py).
        nbytes = self.runner.state.state_layout.slot_bytes(cache["conv"], cache["rec"])
        if not self.host.fits(nbytes):  # decided before reading: no device copy for a snapshot the host cannot hold
            return
        # Not waited for: the copy is dispatched after the step just launched and lands while the host goes on
        # (memory/host_snapshots.py); the slot may be reused at once, the copy reads it first.
        conv, rec = self.runner.state.read_slot_async(sid)
        for old in self.host.over_budget_ids(nbytes):
            old_key = self._where.get(old)
            if old_key is not None and self.tree.drop_snapshot(old_key, old):
                self._where.pop(old)
                self.host.drop(old)
        if self.host.used_bytes + nbytes > self.host.budget_bytes:
            return
        hid = self.host.put(conv, rec)
        if self.tree.set_snapshot(key, hid) == hid:  # its KV is gone meanwhile: nothing to attach to
            self.host.drop(hid)
        else:
            self._where[hid] = key

    # ---- admin ---------------------------------------------------------------------------------
    def flush(self) -> None:
        """Empty the tree (caller guarantees no request holds a lock) and free everything it held."""
        freed = self.tree.reset()
        self.kv_pool.free(freed.pages)
        self._release_snapshots(freed.snapshots, demote=False)

    def stats(self) -> dict[str, Any]:
        """Usage figures; O(1) reads only, since /get_server_info calls this from the HTTP thread while the
        scheduler thread changes the tree (tree.stats() walks it)."""
        c = self.tree.counters()
        hits, queries = c["hit_tokens"], c["query_tokens"]
        out = {"cached_pages": self.tree.num_pages, "cached_snapshots": self.tree.num_snapshots,
               "cache_hit_rate": hits / queries if queries else 0.0,
               "cache_hit_tokens": hits, "cache_query_tokens": queries,
               "evicted_pages": c["evicted_pages"], "evicted_snapshots": c["evicted_snapshots"],
               "snapshot_hits_device": self.snapshot_hits["device"], "snapshot_hits_host": self.snapshot_hits["host"],
               "host_snapshots": len(self.host), "host_snapshot_bytes": self.host.used_bytes,
               "host_snapshot_budget_bytes": self.host.budget_bytes,
               "host_snapshots_pending": self.host.num_pending,
               "host_snapshot_refused_low_memory": self.host.refused_low_memory}
        if self.snap_pool is not None:
            out.update(snapshot_slots_total=self.snap_pool.num_usable, snapshot_slots_free=self.snap_pool.num_free)
        elif self.has_gdn:  # the memory split left no snapshot slots
            out.update(snapshot_slots_total=0, snapshot_slots_free=0)
        return out
