"""A prefix KV cache for the embedded engine: the keys and values of token sequences seen before.

Why: the n samples of one prompt send the same prompt, and each turn of a multi-turn trajectory
sends the previous turn's prompt and output again with a few new tokens. A causal model's K/V at a
position depend only on the tokens up to it, so the K/V of any stored sequence serve every prompt
that starts with a prefix of it, and only the rest of the prompt needs a forward pass.

How: a radix tree over token ids. Each node holds a run of tokens (the edge from its parent) and
their K/V as one tensor ``[layers, 2, kv_heads, len(run), head_dim]``; a path from the root spells a
stored sequence, so shared prefixes are held once. The bound counts tokens held; past it the least
recently used leaf loses its tail (a leaf's prefix stays valid), or all of it. Nothing here is
thread-safe: the batcher calls it under its step lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from miles.lazy import lazy_module

torch = lazy_module("torch")

__all__ = ["PrefixCache"]


class _Node:
    __slots__ = ("tokens", "kv", "parent", "children", "used")

    def __init__(self, tokens: tuple[int, ...], kv: torch.Tensor | None, parent: _Node | None, used: int) -> None:
        self.tokens, self.kv, self.parent, self.used = tokens, kv, parent, used
        self.children: dict[int, _Node] = {}  # by first token


class PrefixCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0  # held now
        self._root = _Node((), None, None, 0)
        self._clock = itertools.count(1)

    def clear(self) -> None:
        self._root.children.clear()
        self.tokens = 0

    def match(self, tokens: Sequence[int], limit: int) -> tuple[int, torch.Tensor | None]:
        """The longest held prefix of ``tokens[:limit]``: its length and K/V ``[layers, 2, kv_heads, length, head_dim]``
        (None when nothing matches). The nodes on the way count as used."""
        node, pos, parts, now = self._root, 0, [], next(self._clock)
        while pos < limit and (child := node.children.get(tokens[pos])) is not None:
            m = _common(child.tokens, tokens, pos, limit)
            child.used = now
            parts.append(child.kv[..., :m, :])
            pos += m
            if m < len(child.tokens):
                break
            node = child
        return pos, (torch.cat(parts, dim=-2) if parts else None)

    def held(self, tokens: Sequence[int]) -> int:
        """How many tokens from the start of ``tokens`` are held (what :meth:`insert` need not be given K/V for). The
        nodes on the way count as used, as if they had been inserted again."""
        node, pos, end, now = self._root, 0, min(len(tokens), self.max_tokens), next(self._clock)
        while pos < end and (child := node.children.get(tokens[pos])) is not None:
            m = _common(child.tokens, tokens, pos, end)
            child.used = now
            pos += m
            if m < len(child.tokens):
                break
            node = child
        return pos

    def insert(self, tokens: Sequence[int], kv: torch.Tensor, start: int = 0) -> None:
        """Hold ``tokens`` with their K/V ``kv`` ``[layers, 2, kv_heads, len(tokens) - start, head_dim]``, the K/V of
        ``tokens[start:]`` (``start``: at most :meth:`held`; only the part not held yet is copied), then evict down
        to the bound."""
        tokens = tuple(tokens[: self.max_tokens])
        node, pos, now = self._root, 0, next(self._clock)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:  # a new leaf with the rest
                if pos < start:
                    raise ValueError(f"insert: K/V from token {start}, but only {pos} tokens are held")
                node.children[tokens[pos]] = _Node(tokens[pos:], kv[..., pos - start:len(tokens) - start, :].clone(),
                                                   node, now)
                self.tokens += len(tokens) - pos
                break
            m = _common(child.tokens, tokens, pos, len(tokens))
            child.used = now
            if m < len(child.tokens) and pos + m < len(tokens):  # the sequences part inside this run: split it
                child = self._split(child, m)
            node, pos = child, pos + m
        self._evict()

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut ``node``'s run after ``m`` tokens; returns the new upper node (``node`` becomes its child)."""
        upper = _Node(node.tokens[:m], node.kv[..., :m, :].clone(), node.parent, node.used)
        node.parent.children[node.tokens[0]] = upper
        node.tokens, node.kv, node.parent = node.tokens[m:], node.kv[..., m:, :].clone(), upper
        upper.children[node.tokens[0]] = node
        return upper

    def _evict(self) -> None:
        if self.tokens <= self.max_tokens:
            return
        leaves, stack, order = [], list(self._root.children.values()), itertools.count()
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if not n.children:
                leaves.append((n.used, next(order), n))
        heapq.heapify(leaves)
        while self.tokens > self.max_tokens:
            _, _, leaf = heapq.heappop(leaves)
            excess = self.tokens - self.max_tokens
            if excess < len(leaf.tokens):  # keep the leaf's head
                leaf.tokens, leaf.kv = leaf.tokens[:-excess], leaf.kv[..., :-excess, :].clone()
                self.tokens -= excess
                break
            parent = leaf.parent
            del parent.children[leaf.tokens[0]]
            self.tokens -= len(leaf.tokens)
            if parent is not self._root and not parent.children:
                heapq.heappush(leaves, (parent.used, next(order), parent))


def _common(run: tuple[int, ...], tokens: Sequence[int], pos: int, end: int) -> int:
    """How many tokens of ``run`` equal ``tokens[pos:end]`` from the start."""
    n = min(len(run), end - pos)
    i = 0
    while i < n and run[i] == tokens[pos + i]:
        i += 1
    return i
