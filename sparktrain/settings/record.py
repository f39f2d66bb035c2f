"""The settings, resolved once, as typed frozen records: :class:`RankSettings`, those a rank reads
in its environment, and :class:`Settings`, every setting of the table, which the driver resolves.

A field is a setting of the table (``sparktrain.settings.SETTINGS``) by its name, the type its
parser returns. ``sparktrain.settings`` checks at import that the records' fields are the table's
names, no more and no fewer, so a setting added to the table without its field, or a misspelt
field, fails there; ``tests/test_settings.py`` checks that every setting the package reads off a
record is one of its fields.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True, slots=True)
class RankSettings:
    """The settings a rank reads (the table's ``read_in`` "rank" or "both"), resolved once.

    ``origin(name)`` says where a value came from: "argument", "environment", "conf" or "default".
    """

    encryption: str
    elastic_url: str | None
    collective_timeout: float
    cpu_collectives: str
    cpu_transport: str
    spin_wait: str | float
    tf_kernels: bool
    legacy_keras: bool | None
    pin_cores: str
    gc_threshold: str
    data_cache_limit: int | str
    bucket_bytes: int
    timeline: str | None
    origins: Mapping[str, str] = dataclasses.field(default_factory=dict, repr=False, compare=False, kw_only=True)

    def origin(self, name: str) -> str:
        return self.origins[name]

    def __getitem__(self, name: str) -> Any:
        """A setting by its name (a name no field has raises KeyError)."""
        if name not in names(type(self)):
            raise KeyError(name)
        return getattr(self, name)


@dataclasses.dataclass(frozen=True, slots=True)
class Settings(RankSettings):
    """Every setting of the table, resolved once on the driver (``driver.launch.config``)."""

    start_timeout: float
    grace_period: float
    heartbeat_timeout: float
    rendezvous: str
    allow_unencrypted: bool
    max_attempts: int
    spill_url: str | None
    log_url: str | None
    lease_timeout: float
    elastic_grow_after: float
    stall_warning: float
    nics: tuple[str, ...] | None
    capacity_wait: float
    warm_rank_process: bool
    backend: str | None
    jax_cpu_devices: int


def names(record: type) -> tuple[str, ...]:
    """The settings a record holds: its fields but ``origins``."""
    return tuple(f.name for f in dataclasses.fields(record) if f.name != "origins")
