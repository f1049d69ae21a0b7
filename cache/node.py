"""The radix tree's node, the integrity error, and walks over nodes.

A ``Node`` is one edge of the prefix tree: ``key`` holds its tokens (a non-empty
multiple of page_size, except the root's empty key) and ``value`` the KV pages
that hold them, one page per page_size tokens. ``children`` maps the first page of
a child's key (a tuple of page_size token ids) to the child. The tree in
``radix.py`` owns every field; everyone else only reads them::

    parent ──children[key[:page_size]]──> node ──> ...
       ^──────────── node.parent ──────────┘

``lock_ref`` counts locks held at the node or below it, ``num_locks`` those held at
the node itself; ``evicted`` marks a node that has left the tree (a request's
handle to it is then stale, which ``KVCache.check_integrity`` reports).
"""

from __future__ import annotations

__all__ = ["IntegrityError", "Node", "Tokens", "node_problem", "path_pages", "walk"]

Tokens = tuple[int, ...]


class IntegrityError(AssertionError):
    """A cache invariant does not hold."""


class Node:
    """One edge of the tree: ``key`` tokens whose KV lives in ``value`` pages."""

    __slots__ = (
        "children",
        "evicted",
        "key",
        "last_access",
        "lock_ref",
        "num_locks",
        "parent",
        "value",
    )

    def __init__(self, key: Tokens, value: list[int], parent: Node | None, now: int) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[Tokens, Node] = {}
        self.lock_ref = 0  # locks held at this node or below
        self.num_locks = 0  # locks held at this node itself
        self.last_access = now
        self.evicted = False

    def __repr__(self) -> str:
        return (
            f"Node(key_len={len(self.key)}, pages={self.value}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)}, last_access={self.last_access})"
        )


def walk(root: Node) -> list[Node]:
    """Every node below ``root``, parents before children (iterative: trees can be deep)."""
    out: list[Node] = []
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(node.children.values())
    return out


def path_pages(node: Node) -> list[int]:
    """The pages on the path from the root down to ``node``, in token order."""
    chunks: list[list[int]] = []
    n: Node | None = node
    while n is not None:
        chunks.append(n.value)
        n = n.parent
    return [page for chunk in reversed(chunks) for page in chunk]


def node_problem(node: Node, page_size: int, clock: int) -> str | None:
    """What is wrong with one non-root node and its links, or None if it is well formed."""
    parent = node.parent
    n = len(node.key)
    if parent is None or node.evicted:
        return "detached or evicted node in the tree"
    if n == 0 or n % page_size:
        return f"key length {n} is not a positive multiple of page_size {page_size}"
    if len(node.value) != n // page_size:
        return f"{n} tokens but {len(node.value)} pages"
    if parent.children.get(node.key[:page_size]) is not node:
        return "not its parent's child under its first page"
    if node.last_access > clock:
        return f"last_access from the future (clock {clock})"
    expected = node.num_locks + sum(c.lock_ref for c in node.children.values())
    if node.num_locks < 0 or node.lock_ref != expected:
        return f"lock_ref {node.lock_ref} != own locks + children's lock_refs = {expected}"
    return None
