"""The shared store contract: where the shared cache tier (L3) keeps its values.

A store kind names itself and the URL schemes it serves (``redis``, ``rediss``, ``unix`` for the
built-in Redis store) and opens a :class:`SharedStore` for a URL. A store is a key-value map with
sets: it never interprets the values (the tier's records carry their own checksums, so a store
may drop, truncate or lose anything; that is a miss, never wrong data). The tier calls a store
only from its own threads, never from the engine's worker, and a store may be called from two
threads at once (the writer and the lookup thread).

Every method raises :class:`SharedStoreUnavailable` when the store cannot be reached or answers
too late (the tier then treats the store as down for a while and serves from its own tiers).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from hpc_cli.cache.shared import StoreKey  # a key of the store (ASCII, under 100 bytes)
from hpc_cli.errors import HpcError

__all__ = ["SharedStore", "SharedStoreKind", "SharedStoreUnavailable", "StoreInfo", "StoreKey"]


class SharedStoreUnavailable(HpcError):
    """The shared store cannot be reached or did not answer in time."""


@dataclass(frozen=True, slots=True)
class StoreInfo:
    """What a store says about itself (``/v1/cache/stats``): a description of where it is (no
    credentials), its used bytes and key count when it knows them."""

    where: str
    used_bytes: int | None = None
    keys: int | None = None


class SharedStore(ABC):
    """One open store. Values are bytes; a missing value is ``None``."""

    @abstractmethod
    def get(self, keys: Sequence[StoreKey]) -> list[bytes | None]:
        """The values of ``keys``, in order (``None`` where a key has no value)."""

    @abstractmethod
    def put(self, items: Sequence[tuple[StoreKey, bytes]]) -> list[bool]:
        """Set each key that has no value yet (a key already set keeps its value); True where
        this call wrote the value."""

    @abstractmethod
    def add_members(self, key: StoreKey, members: Sequence[bytes]) -> None:
        """Add ``members`` to the set at ``key``."""

    @abstractmethod
    def members(self, keys: Sequence[StoreKey]) -> list[frozenset[bytes]]:
        """The members of the set at each key, in order (empty where there is none)."""

    @abstractmethod
    def remove_members(self, key: StoreKey, members: Sequence[bytes]) -> None:
        """Remove ``members`` from the set at ``key`` (stale entries)."""

    def info(self) -> StoreInfo:
        """Where the store is and how full (best effort)."""
        return StoreInfo(where=type(self).__name__)

    def close(self) -> None:
        """Release connections; the store is not used afterwards."""


class SharedStoreKind:
    """A registered kind of store. ``name`` and ``aliases`` are the URL schemes it serves."""

    name: str = ""
    aliases: tuple[str, ...] = ()
    description: str = ""

    def open(self, url: str, *, timeout_s: float) -> SharedStore:
        """Open the store at ``url``; every call on it gives up after ``timeout_s`` seconds.
        Raise ``hpc_cli.errors.ConfigError`` for a URL this kind cannot use. Opening must not
        need the store to be up (a store that is down is a run of misses, not a failed start)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<SharedStoreKind {self.name}>"
