"""The cache mode contract: a mode names itself, brings its options model (a pydantic model read
from the profile's ``[cache.<mode>]`` table), validates option combinations (spec "Coexistence
rules", §14.2), derives its effective values, and later builds the resource manager the
engine talks to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
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

    def derive(self, settings: "HpcSettings", options: BaseModel) -> dict[str, Any]:
        """Effective values of the options left unset (spec §14.2); key -> value."""
        return {}

    def validate(self, settings: "HpcSettings", options: BaseModel) -> None:
        """Raise ConfigError for a forbidden combination."""

    def __repr__(self) -> str:
        return f"<CacheMode {self.name}>"
