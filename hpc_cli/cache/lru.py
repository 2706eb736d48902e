"""Intrusive doubly-linked lists with O(1) removal from the middle (spec §9.1).

An entry is any object with the slots ``lru_prev``, ``lru_next`` and ``lru_list`` (BlockNode
and Snapshot have them; a snapshot is linked for its tail page bundle). The head is the least
recently used end, the tail the MRU end. An entry is in at most one list at a time.

The device LRU is two such lists, ``backed`` (a host copy exists: evicting drops only the
device copy) and ``unbacked`` (evicting loses the last copy, §9.4); backed entries are
consumed first.
"""

from __future__ import annotations

from typing import Iterator, Protocol


class LruEntry(Protocol):
    """What a list links: its neighbours and the list it is in (None when in none)."""

    lru_prev: "LruEntry | None"
    lru_next: "LruEntry | None"
    lru_list: "LruList | None"


class _Sentinel:
    __slots__ = ("lru_prev", "lru_next", "lru_list")

    def __init__(self) -> None:
        self.lru_prev = self
        self.lru_next = self
        self.lru_list = None


class LruList:
    """One intrusive list. ``append`` puts an entry at the MRU end; ``head`` is the LRU one."""

    __slots__ = ("name", "_s", "_len")

    def __init__(self, name: str) -> None:
        self.name = name
        self._s = _Sentinel()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, entry: LruEntry) -> bool:
        return entry.lru_list is self

    def append(self, entry: LruEntry) -> None:
        """Link ``entry`` at the MRU end (it must not be in any list)."""
        assert entry.lru_list is None, f"{entry!r} is already in list {entry.lru_list.name}"
        s = self._s
        last = s.lru_prev
        entry.lru_prev = last
        entry.lru_next = s
        last.lru_next = entry
        s.lru_prev = entry
        entry.lru_list = self
        self._len += 1

    def remove(self, entry: LruEntry) -> None:
        """Unlink ``entry`` in O(1)."""
        assert entry.lru_list is self, f"{entry!r} is not in list {self.name}"
        p, n = entry.lru_prev, entry.lru_next
        p.lru_next = n
        n.lru_prev = p
        entry.lru_prev = entry.lru_next = entry.lru_list = None
        self._len -= 1

    def move_to_mru(self, entry: LruEntry) -> None:
        self.remove(entry)
        self.append(entry)

    def head(self) -> LruEntry | None:
        """The LRU entry, or None."""
        first = self._s.lru_next
        return None if first is self._s else first

    def __iter__(self) -> Iterator[LruEntry]:
        """From the LRU end to the MRU end. Do not mutate the list while iterating."""
        s = self._s
        e = s.lru_next
        while e is not s:
            yield e
            e = e.lru_next

    def check(self) -> None:
        """Walk the links both ways and compare with the length (for check_invariants)."""
        s = self._s
        count = 0
        prev = s
        e = s.lru_next
        while e is not s:
            assert e.lru_list is self, f"list {self.name}: entry {e!r} links to another list"
            assert e.lru_prev is prev, f"list {self.name}: broken back link at {e!r}"
            prev = e
            e = e.lru_next
            count += 1
            assert count <= self._len, f"list {self.name}: longer than its length {self._len}"
        assert s.lru_prev is prev, f"list {self.name}: sentinel back link broken"
        assert count == self._len, f"list {self.name}: walked {count} entries, length says {self._len}"
