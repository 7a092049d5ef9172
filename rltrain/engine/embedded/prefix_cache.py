"""The paged path's prefix cache: the KV pages of finished rows, kept and served to the requests
whose prompts extend them (a multi-turn trajectory's next turn, a prompt sent again).

    cache = PrefixCache(pool)
    hit = cache.match(prompt)               # the longest cached prefix (no reference taken)
    cache.insert(tokens, pages)             # a finished row's pages: `tokens` have keys in them
    cache.evict(pages)                      # make room in the pool, least recently used first
    cache.clear()                           # every page given back (weights changed, a flush)

A trie of pages: each node is one full page of `page_size` tokens, keyed by those tokens under
its parent (so a node stands for the whole prefix up to its page, and a page's keys and values
are only ever served after the same tokens at the same positions). A node may also keep *tails*:
the last, partial page of a finished row, keyed by the tokens it holds. A row's pages go in when
it finishes; the keys written are those of its prompt and of every sampled token but the last
(the last is never fed back), so a turn's next request, `prompt + output + observation`, finds
everything up to its previous output's last token.

The cache holds one reference on each page it keeps (kv_pool.py's counts): a page a running row
also holds stays in the pool until both let go. A hit hands the caller the full pages to share
(the caller takes its reference) and, where the match ends inside a page, that page and how many
of its tokens match: the caller copies it (or `take`s a tail nobody else holds) before writing
past them. A match always leaves at least one prompt token to prefill (its logits sample the
first token). Eviction gives back pages only the cache holds, least recently used first, leaves
before their parents.

What the keys were computed with is the caller's to track: the engine clears the cache whenever
its weights change or its memory is released (batching.py, by the engine state's epoch).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from rltrain.engine.embedded.kv_pool import KVPool


@dataclass(eq=False)
class _Node:
    """One cached full page (the root has none), its children by their tokens, its tails."""

    page: int
    parent: _Node | None
    key: tuple[int, ...]
    children: dict[tuple[int, ...], _Node] = field(default_factory=dict)
    tails: dict[tuple[int, ...], int] = field(default_factory=dict)  # partial page's tokens -> page
    used: int = 0  # the clock's tick of its last match or insert


@dataclass
class Hit:
    """A cached prefix of a prompt: `pages` hold its first len(pages) * page_size tokens; then
    `partial` (a page) holds `partial_tokens` more of them (copy it before writing into it);
    `tail`: that page is a tail entry (`PrefixCache.take` can hand it over instead)."""

    pages: list[int]
    partial: int | None = None
    partial_tokens: int = 0
    tail: tuple[_Node, tuple[int, ...]] | None = None

    def tokens(self, page_size: int) -> int:
        return len(self.pages) * page_size + self.partial_tokens


class PrefixCache:
    """Finished rows' pages by their tokens (module doc), in `pool`."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.P = pool.page_size
        self.root = _Node(0, None, ())
        self._clock = itertools.count(1)
        self.pages = 0  # pages held (full and tails)

    def match(self, prompt: list[int]) -> Hit:
        """The longest cached prefix of `prompt`, at most len(prompt) - 1 tokens."""
        P, limit = self.P, len(prompt) - 1
        node, pages, tick = self.root, list[int](), next(self._clock)
        while (len(pages) + 1) * P <= len(prompt):
            child = node.children.get(tuple(prompt[len(pages) * P : (len(pages) + 1) * P]))
            if child is None:
                break
            node = child
            node.used = tick
            pages.append(node.page)
        if len(pages) * P > limit:  # the whole prompt is cached: its last page is used in part
            last = pages.pop()
            return Hit(pages, last, limit - len(pages) * P)
        rest = prompt[len(pages) * P : limit]
        best: tuple[int, ...] = ()
        for key in node.tails:
            if len(best) < len(key) <= len(rest) and tuple(rest[: len(key)]) == key:
                best = key
        if best:
            node.used = tick
            return Hit(pages, node.tails[best], len(best), (node, best))
        return Hit(pages)

    def take(self, hit: Hit) -> int | None:
        """Hand `hit`'s tail page over to the caller (with the cache's reference) where nothing else
        holds it; None where it is shared (then copy it)."""
        if hit.tail is None or hit.partial is None or self.pool.refs(hit.partial) != 1:
            return None
        node, key = hit.tail
        if node.tails.get(key) != hit.partial:  # another hit of the same batch took it first
            return None
        del node.tails[key]
        self.pages -= 1
        return hit.partial

    def insert(self, tokens: list[int], pages: list[int]) -> None:
        """Keep the pages holding `tokens`' keys (page k holds tokens [k*P, (k+1)*P)). A prefix
        already cached keeps its own pages; every page kept gets the cache's reference."""
        P, node, tick = self.P, self.root, next(self._clock)
        full = len(tokens) // P
        for k in range(full):
            key = tuple(tokens[k * P : (k + 1) * P])
            child = node.children.get(key)
            if child is None:
                child = node.children[key] = _Node(pages[k], node, key)
                self.pool.share([pages[k]])
                self.pages += 1
            child.used = tick
            node = child
        tail = tuple(tokens[full * P :])
        if tail and tail not in node.tails:
            node.tails[tail] = pages[full]
            self.pool.share([pages[full]])
            self.pages += 1
            node.used = tick

    def evictable(self) -> int:
        """Pages that eviction could give back to the pool now (only the cache holds them)."""
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            stack += node.children.values()
            count += sum(self.pool.refs(p) == 1 for p in node.tails.values())
            if node is not self.root and self.pool.refs(node.page) == 1:
                count += 1
        return count

    def evict(self, want_free: int) -> None:
        """Give pages back, least recently used first (tails, then childless nodes), until the
        pool has `want_free` free pages or nothing more can go."""
        while self.pool.free < want_free and self.pages:
            leaves: list[tuple[int, _Node, tuple[int, ...] | None]] = []
            stack = [self.root]
            while stack:
                node = stack.pop()
                stack += node.children.values()
                leaves += [(node.used, node, key) for key, p in node.tails.items() if self.pool.refs(p) == 1]
                if node is not self.root and not node.children and not node.tails and self.pool.refs(node.page) == 1:
                    leaves.append((node.used, node, None))
            if not leaves:
                return
            leaves.sort(key=lambda x: x[0])
            for _, node, key in leaves:
                if self.pool.free >= want_free:
                    return
                self._drop(node, key)

    def _drop(self, node: _Node, key: tuple[int, ...] | None) -> None:
        if key is not None:
            self.pool.release([node.tails.pop(key)])
        else:
            assert node.parent is not None
            del node.parent.children[node.key]
            self.pool.release([node.page])
        self.pages -= 1

    def clear(self) -> None:
        """Give every page back."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack += node.children.values()
            self.pool.release(list(node.tails.values()))
            if node is not self.root:
                self.pool.release([node.page])
        self.root = _Node(0, None, ())
        self.pages = 0
