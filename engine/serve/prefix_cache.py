"""The prefix cache: decoding states of recent prompts, so a prompt that extends one (a chat's
earlier turns) restores that state and prefills only its new tokens.

Entries are keyed by (attention path, prompt ids) and hold a batch-1 state of the whole prompt
(a KV cache cut to its slots; a linear state, fixed size whatever the length; a window state packed
to the slots it holds, State.packed) and the logits of
its last position, so an identical prompt skips prefill entirely. Least recently used entries
go first once `max_entries` or `max_bytes` is passed.

Time saved is an estimate: cached tokens x the mean prefill seconds per token of the misses.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    stored: object             # the batch-1 State holding the prompt (capacity = its slots), packed
    logits: torch.Tensor       # (1, V) at the prompt's last position
    nbytes: int

    @property
    def state(self):
        """The prompt's state: a KV state itself; a window state (packed: only the slots it holds) a fresh copy."""
        return self.stored.unpacked()


class PrefixCache:
    def __init__(self, max_entries: int = 64, max_bytes: int = 256 * 2 ** 20, min_tokens: int = 2):
        self.max_entries, self.max_bytes, self.min_tokens = max_entries, max_bytes, min_tokens
        self.entries: OrderedDict[tuple, Entry] = OrderedDict()
        self.lock = threading.Lock()
        self.hits = self.misses = self.tokens_saved = 0
        self.prefill_tokens, self.prefill_s = 0, 0.0

    def lookup(self, path: str, ids: list[int]):
        """The entry of the longest cached prompt that `ids` starts with: (Entry, its length), or None."""
        best = None
        with self.lock:
            for (p, key), entry in self.entries.items():
                n = len(key)
                if p == path and n <= len(ids) and (best is None or n > best[1]) and tuple(ids[:n]) == key:
                    best = (entry, n)
            if best is None or best[1] < self.min_tokens:
                self.misses += 1
                return None
            self.hits += 1
            self.tokens_saved += best[1]
            self.entries.move_to_end((path, tuple(ids[:best[1]])))
        return best

    def put(self, path: str, ids: list[int], state, logits: torch.Tensor, owned: bool = False) -> None:
        """Keep a copy of `state` (batch 1, holding exactly `ids`) and the last logits (1, V). owned: the
        caller hands `state` over and never writes to it again; a state whose capacity is its slots (or
        none: linear) is then kept as it is, without a copy. An entry's state is only ever read."""
        if len(ids) < self.min_tokens or self.max_entries == 0:
            return
        if owned and state.max_len in (None, state.slots):
            copy = state
        else:
            copy = state.select_rows([0], max_len=state.slots if state.max_len is not None else None)
        copy = copy.packed()   # a window state: the slots it holds (engine.attention.packed)
        entry = Entry(copy, logits.detach().clone(), copy.nbytes + logits.numel() * logits.element_size())
        with self.lock:
            self.entries[(path, tuple(ids))] = entry
            self.entries.move_to_end((path, tuple(ids)))
            while self.entries and (len(self.entries) > self.max_entries or self.bytes > self.max_bytes):
                self.entries.popitem(last=False)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens += tokens
        self.prefill_s += seconds

    @property
    def bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def stats(self) -> dict:
        with self.lock:
            per_token = self.prefill_s / self.prefill_tokens if self.prefill_tokens else 0.0
            by_path: dict[str, dict] = {}
            for (path, key), e in self.entries.items():
                d = by_path.setdefault(path, {"entries": 0, "bytes": 0, "tokens": 0})
                d["entries"] += 1
                d["bytes"] += e.nbytes
                d["tokens"] += len(key)
            lookups = self.hits + self.misses
            return {"hits": self.hits, "misses": self.misses,
                    "hit_rate": self.hits / lookups if lookups else 0.0,
                    "tokens_saved": self.tokens_saved,
                    "time_saved_s": self.tokens_saved * per_token,
                    "prefill_s_per_token": per_token,
                    "bytes": sum(d["bytes"] for d in by_path.values()), "by_path": by_path}
