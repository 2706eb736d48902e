"""The cache mode contract: a mode names itself, brings its options model (a pydantic model read
from the profile's ``[cache.<mode>]`` table), validates option combinations (spec "Coexistence
rules", §14.2), derives its effective values, says how many state slots it keeps beyond the
lanes', and builds the cache binding the engine talks to (:mod:`hpc_cli.engine.binding`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from hpc_cli.errors import ConfigError

if TYPE_CHECKING:
    from hpc_cli.engine.binding import BindingContext, CacheBinding
    from hpc_cli.model.model import HybridModel
    from hpc_cli.settings import HpcSettings


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheMode:
    name: str = ""
    aliases: tuple[str, ...] = ()
    description: str = ""
    #: the pydantic model of this mode's ``[cache.<name>]`` table
    options_model: type[BaseModel] = NoOptions
    #: False for modes that never reuse a prefix (``off``)
    reuses: bool = True
    #: True when the prefix cache file (``cache.prefix_cache_file``, spec §5.5) applies
    persistent: bool = False

    def derive(self, settings: "HpcSettings", options: BaseModel) -> dict[str, Any]:
        """Effective values of the options left unset (spec §14.2); key -> value."""
        return {}

    def validate(self, settings: "HpcSettings", options: BaseModel) -> None:
        """Raise ConfigError for a forbidden combination. The base rejects the options tables
        of other modes (the coexistence rule); a mode that overrides this calls it too."""
        reject_foreign_tables(settings, self)

    def snapshot_slots(self, options: BaseModel, *, lanes: int, host: bool) -> int:
        """State slots this mode keeps beyond the lanes' own: the engine allocates ``lanes`` +
        this many and hands them over in :class:`~hpc_cli.engine.binding.BindingContext`."""
        return 0

    def tap_slots(self, options: BaseModel, *, model: "HybridModel", speculative: bool) -> int:
        """State slots a prefill pass of this mode writes the images of its exact taps into
        (the zero-split tap): the engine allocates them after :meth:`snapshot_slots` and hands
        the count over in :class:`~hpc_cli.engine.binding.BindingContext` (``tap_slots``).
        ``speculative``: the engine's speculative backend adds parts to the state image (DFlash2's
        rings), which a pass does not tap (a backend whose state lives in pages, MTP or DFlash,
        does not count)."""
        return 0

    def build(self, context: "BindingContext") -> "CacheBinding":
        """The engine's cache binding for this mode."""
        raise NotImplementedError(f"cache mode {self.name!r} does not build a binding")

    def __repr__(self) -> str:
        return f"<CacheMode {self.name}>"


def reject_foreign_tables(settings: "HpcSettings", mode: CacheMode) -> None:
    """Raise ConfigError when an options table of another registered mode is set."""
    from hpc_cli import plugins

    regs = plugins.registries().cache_modes
    for name, table in (settings.cache.model_extra or {}).items():
        if name in regs and regs.canonical(name) != mode.name and table:
            canonical = regs.canonical(name)
            keys = ", ".join(table) if isinstance(table, dict) else name
            raise ConfigError(f"[cache.{name}] options are set but cache.mode is {mode.name!r} ({keys} apply "
                              f"only to cache mode {canonical!r})",
                              hint=f"remove the [cache.{name}] table or set cache.mode = {canonical!r}")


def reject_settings(settings: "HpcSettings", mode: CacheMode, keys: dict[str, str]) -> None:
    """Raise ConfigError for the first of ``keys`` (dotted settings key -> why it does not
    apply) that is set to something other than its default while ``mode`` is selected."""
    from hpc_cli.settings import HpcSettings

    defaults = HpcSettings.model_construct()
    for dotted, why in keys.items():
        section, leaf = dotted.split(".", 1)
        sec = getattr(settings, section)
        value = getattr(sec, leaf, None)
        default = getattr(getattr(defaults, section), leaf, None)
        if value is not None and value != default:
            raise ConfigError(f"{dotted} does not apply to cache mode {mode.name!r}: {why}",
                              hint=f"remove {dotted}, or choose a cache mode it applies to")
