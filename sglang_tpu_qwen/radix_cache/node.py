"""One node of the radix tree: a page-aligned edge of token ids, its KV page ids, an optional snapshot."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field


@dataclass(eq=False)
class TreeNode:
    """A node of `RadixCache`; the edge from `parent` to this node carries `key`.

    key:         token ids on the edge, ``len(key) % page_size == 0`` (empty only for a root).
    pages:       KV page ids, one per page of `key` (``len(pages) == len(key) // page_size``).
    snapshot:    GDN snapshot slot id holding the exact state after the ``depth`` tokens up to the END of
                 this node, or None.
    depth:       tokens from the root to the end of this node.
    lock_ref:    number of `RadixCache.lock` calls on this node or a descendant (path lock): > 0 means the
                 node and its pages are never evicted.
    direct_lock: number of `lock` calls on this very node: > 0 also protects its snapshot.
    last_access: logical clock value of the last match / insert / set_snapshot that touched the node.
    namespace:   the namespace of the tree the node belongs to.

    Nodes are identity-compared (handles the caller keeps between `match_prefix` and `unlock`).
    """

    key: tuple[int, ...]
    pages: list[int]
    parent: TreeNode | None = field(repr=False)
    depth: int
    namespace: Hashable = None
    snapshot: int | None = None
    lock_ref: int = 0
    direct_lock: int = 0
    last_access: int = 0
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict, repr=False)

    @property
    def is_root(self) -> bool:
        """True for the root of a namespace (empty key, no parent)."""
        return self.parent is None

    def path_to_root(self) -> list[TreeNode]:
        """This node and its ancestors, deepest first, root last."""
        out: list[TreeNode] = []
        node: TreeNode | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out
