"""The block bundle: where each (pool, layer, plane) page of one block lives inside its host
slab (spec §5.4, §11.2). A slab holds one bundle: the main pool's page, every layer's planes back
to back (layer-major, planes in profile order), then the backend pool's page at the next 4 KiB
boundary; ``slab_bytes`` is that record rounded up to 4 KiB. A state image takes
``ceil(image_bytes / slab_bytes)`` slabs wherever they are free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_cli.memory.kv_pool import PagedKVStorage

SLAB_ALIGN = 4096


def round_up(n: int, align: int = SLAB_ALIGN) -> int:
    return -(-n // align) * align


def image_slab_count(image_bytes: int, slab_bytes: int) -> int:
    """Slabs one state image occupies: ``ceil(image_bytes / slab_bytes)``."""
    return -(-image_bytes // slab_bytes)


@dataclass(frozen=True, slots=True)
class BundleLayout:
    """Where each (pool, layer, plane) page of one block lives inside its slab.

    ``main_plane_bytes[j]`` is the bytes of one page of plane ``j`` (the same in every layer);
    the main page is ``main_layers`` layers of those planes back to back, layer-major. The
    backend page (its own pool, ``backend_*``) starts at the next 4 KiB boundary.
    """

    main_plane_bytes: tuple[int, ...]
    main_layers: int
    backend_plane_bytes: tuple[int, ...] = ()
    backend_layers: int = 0

    @classmethod
    def for_storage(cls, main: "PagedKVStorage", backend: "PagedKVStorage | None" = None) -> "BundleLayout":
        return cls(tuple(main.plane_page_bytes), main.num_layers,
                   tuple(backend.plane_page_bytes) if backend is not None else (),
                   backend.num_layers if backend is not None else 0)

    @property
    def main_bytes(self) -> int:
        return sum(self.main_plane_bytes) * self.main_layers

    @property
    def backend_offset(self) -> int:
        return round_up(self.main_bytes)

    @property
    def backend_bytes(self) -> int:
        return sum(self.backend_plane_bytes) * self.backend_layers

    @property
    def record_bytes(self) -> int:
        return self.backend_offset + self.backend_bytes if self.backend_layers else self.main_bytes

    @property
    def slab_bytes(self) -> int:
        return round_up(self.record_bytes)

    def main_offset(self, layer: int, plane: int) -> int:
        """Byte offset of main layer ``layer``'s plane ``plane`` inside the slab."""
        return layer * sum(self.main_plane_bytes) + sum(self.main_plane_bytes[:plane])

    def backend_plane_offset(self, layer: int, plane: int) -> int:
        return (self.backend_offset + layer * sum(self.backend_plane_bytes)
                + sum(self.backend_plane_bytes[:plane]))

    @property
    def max_plane_bytes(self) -> int:
        return max((*self.main_plane_bytes, *self.backend_plane_bytes))

