"""Eviction scores: recency combined with prefill saved per unit of memory (Marconi, MLSys 2025).

Marconi ("Marconi: Prefix Caching for the Era of Hybrid LLMs", Pan et al., MLSys 2025) scores a cache
entry by ``recency + alpha * flop_efficiency`` where flop efficiency is the compute a hit saves divided by
the bytes the entry occupies. Here compute saved is measured in prompt tokens whose prefill a hit avoids
(prefill cost is close to linear in tokens for the short-to-medium contexts a cache serves) and memory in
"tokens of KV": a page costs ``page_size``, a GDN snapshot costs ``snapshot_cost_tokens``. Lower score =
evicted first.
"""

from __future__ import annotations

from sglang_tpu_qwen.radix_cache.node import TreeNode


def ancestor_snapshot_depth(node: TreeNode) -> int:
    """Depth (tokens) of the deepest strict ancestor of `node` holding a snapshot; 0 when none (the root)."""
    anc = node.parent
    while anc is not None:
        if anc.snapshot is not None:
            return anc.depth
        anc = anc.parent
    return 0


def page_saving_tokens(node: TreeNode, has_gdn: bool) -> int:
    """Prefill tokens a future hit loses if this leaf's pages (and its snapshot) are evicted.

    Without GDN every cached token is reusable: the leaf's edge length. With GDN a hit can only end at a
    snapshot, so a leaf without one saves nothing (its KV is dead weight for hits); a leaf with one saves
    the tokens between the nearest snapshot above it and its end.
    """
    if not has_gdn:
        return len(node.key)
    if node.snapshot is None:
        return 0
    return node.depth - ancestor_snapshot_depth(node)


def snapshot_saving_tokens(node: TreeNode) -> int:
    """Prefill tokens a hit ending at `node` loses if its snapshot is dropped (it falls back to an ancestor)."""
    return node.depth - ancestor_snapshot_depth(node)


def score(last_access: int, clock_lo: int, clock_hi: int, saving_tokens: int, cost_tokens: float,
          alpha: float) -> float:
    """``recency + alpha * eff / (1 + eff)`` with ``eff = saving_tokens / cost_tokens``.

    recency is `last_access` mapped linearly from [clock_lo, clock_hi] to [0, 1] (1 = most recent);
    ``eff / (1 + eff)`` maps the efficiency to [0, 1) without a global maximum. alpha = 0 is pure LRU.
    """
    span = max(1, clock_hi - clock_lo)
    recency = min(1.0, max(0.0, (last_access - clock_lo) / span))
    eff = saving_tokens / cost_tokens if cost_tokens > 0 else 0.0
    return recency + alpha * eff / (1.0 + eff)
