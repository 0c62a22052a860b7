"""Episodes' KV pinned between turns: an episode's finished turn hands its block table (prompt, every turn and the
last, partly filled block) to the pins instead of letting go, so its next turn (history + a tool response) starts
from those blocks and feeds only its new tokens, whatever the LRU evicted meanwhile.

A pin holds one reference on each block of its table, until the episode ends (engine.end_episode), its next turn
takes the table, or the weights change (KV of another version is never reused); a pin of a LoRA adapter's turn also
goes when that adapter is reloaded or unloaded. Pins are bounded: their distinct
blocks stay within PIN_SHARE of the pool; a pin past that unpins the least recently pinned episodes first
(`episode_unpins`), and a pool too full to hold one running row unpins too.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from services.rollout.engine_torch.paged.blocks import Adapter, BlockPool, BlockTable

# Share of the pool's blocks pinned episodes may hold; the rest serves running rows (and the prefix cache's LRU).
PIN_SHARE = 0.5


@dataclass
class Pin:
    """One episode's kept KV: its table, the tokens whose KV the table holds, their weight version and adapter."""

    table: BlockTable
    tokens: list[int]
    version: int
    adapter: Adapter = None


class EpisodePins:
    """Pinned tables by episode id, least recently pinned first, within a budget of distinct blocks."""

    def __init__(self, pool: BlockPool, share: float = PIN_SHARE):
        self.pool = pool
        self.budget = int(pool.num_blocks * share)
        self._pins: OrderedDict[str, Pin] = OrderedDict()
        self._holders: Counter[int] = Counter()          # block -> pins holding it (shared prompt blocks count once)
        self.stats = {"episode_pins": 0, "episode_pin_hits": 0, "episode_unpins": 0}

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def num_blocks(self) -> int:
        return len(self._holders)

    def pin(self, episode: str, table: BlockTable, tokens: list[int], version: int, adapter: Adapter = None) -> bool:
        """Takes over `table` (its references) as `episode`'s kept KV, replacing an older pin of it; whether it was
        kept (a table larger than the whole budget is let go at once)."""
        self.release(episode)
        if len(table.blocks) > self.budget:
            self.pool.free(table)
            return False
        self._pins[episode] = Pin(table, list(tokens[:table.num_tokens]), version, adapter)
        self._holders.update(table.blocks)
        self.stats["episode_pins"] += 1
        while self.num_blocks > self.budget:
            self.evict_one()
        return True

    def take(self, episode: str, tokens: list[int], version: int, adapter: Adapter = None) -> Pin | None:
        """The pin of `episode` for its next turn `tokens` (the caller then holds its table's references), when its
        tokens are a proper prefix of them under this weight version and adapter; else None (a stale pin, or one
        of another adapter, is let go)."""
        pin = self._pins.get(episode)
        if pin is None:
            return None
        n = pin.table.num_tokens
        if pin.version != version or pin.adapter != adapter or n >= len(tokens) or tokens[:n] != pin.tokens:
            self.release(episode)
            return None
        self._forget(episode)
        self.stats["episode_pin_hits"] += 1
        return pin

    def give_back(self, episode: str, pin: Pin) -> None:
        """A taken pin whose turn could not be admitted yet: pinned again (its hit not counted)."""
        self._pins[episode] = pin
        self._holders.update(pin.table.blocks)
        self.stats["episode_pin_hits"] -= 1

    def release(self, episode: str) -> bool:
        """Lets go of `episode`'s pin (its episode ended); whether it had one."""
        if episode not in self._pins:
            return False
        self.pool.free(self._forget(episode).table)
        return True

    def evict_one(self) -> bool:
        """Unpins the least recently pinned episode (memory pressure); whether there was one."""
        if not self._pins:
            return False
        self.release(next(iter(self._pins)))
        self.stats["episode_unpins"] += 1
        return True

    def set_version(self, version: int) -> int:
        """The weights are now `version`: every pin of another version goes; how many."""
        stale = [e for e, p in self._pins.items() if p.version != version]
        for e in stale:
            self.release(e)
        return len(stale)

    def keep_adapters(self, served: set) -> int:
        """Adapters were (re)loaded or unloaded: every pin of an adapter identity not in `served` goes; how many."""
        stale = [e for e, p in self._pins.items() if p.adapter is not None and p.adapter not in served]
        for e in stale:
            self.release(e)
        return len(stale)

    def _forget(self, episode: str) -> Pin:
        pin = self._pins.pop(episode)
        for b in pin.table.blocks:
            self._holders[b] -= 1
            if self._holders[b] == 0:
                del self._holders[b]
        return pin

    def metrics(self) -> dict:
        return {"kv_blocks_pinned": self.num_blocks, "pinned_episodes": len(self._pins), **self.stats}
