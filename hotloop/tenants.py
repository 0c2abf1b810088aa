"""Tenants: who a user belongs to, and the names that scope a tenant's data.

A tenant is a set of users (API key ids, `[tenants.<name>] keys`) with an adapter lineage of
its own: its users are served by its newest version, and their traffic and feedback carry its
name, so that only the tenant's own trainer learns from them. The default tenant is "": every
key id in no tenant, and the lineage hotloop had before tenants existed.

Owns: the rule for a tenant's name (it becomes a NATS subject token and a directory name) and
the map from a key id to its tenant. Does not own: keys (the gateway's `keys.py`), subjects
(`hotloop.bus.feedback_subject`), adapters, or who may do what.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

DEFAULT = ""
"""The default tenant: users in no `[tenants.<name>]`, and the lineage without a name."""
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def check_tenant(name: str) -> str:
    """`name` when it can name a tenant (1-32 of a-z 0-9 _ -, starting with a letter or a
    digit, or "" for the default); else ValueError saying so."""
    # fullmatch: `$` alone also matches before a trailing newline ("acme\n")
    if name != DEFAULT and not _NAME.fullmatch(name):
        raise ValueError(f"tenant name {name!r} must be 1-32 of [a-z0-9_-], starting with a "
                         "letter or a digit")
    return name


class Directory:
    """Key id -> tenant, from `[tenants]` (a mapping of name -> an object with `keys`)."""

    def __init__(self, tenants: Mapping[str, object]):
        self._by_key: dict[str, str] = {}
        for name, tenant in tenants.items():
            check_tenant(name)
            keys: Sequence[str] = getattr(tenant, "keys")
            for key in keys:
                if key in self._by_key:
                    raise ValueError(f"key id {key!r} is in tenants {self._by_key[key]!r} and {name!r}")
                self._by_key[key] = name
        self.names = sorted(tenants)

    def tenant_of(self, key_id: str) -> str:
        """The tenant of a key id (the default tenant, "", for one in no tenant)."""
        return self._by_key.get(key_id, DEFAULT)

    def key_ids(self) -> set[str]:
        """Every key id some tenant names."""
        return set(self._by_key)
