"""User API keys: loading, the id each key is known by, and checking a presented key.

Owns: parsing `key` / `id:key` entries (config list and key file), minting the keys of registry
tenants (`mint`: the secret is shown once and only its digest is kept), holding the keys this
gateway accepts (`KeyRing`: the config keys, fixed, plus each registry tenant's, which the
admin module puts in and takes out as the registry changes), and mapping a presented bearer
token to its key id. The id, never the key, is what traffic and feedback carry.
Does not own: where the token comes from (HTTP header, gRPC metadata), which tenant a key id
is in (`hotloop.tenants.Directory`) or what a caller may do.

Lookup is a dict access on the presented key's sha256: its timing depends on the digest, which
a caller cannot steer towards a stored one, so it leaks nothing useful about stored keys.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Iterable
from pathlib import Path

from hotloop.errors import Unauthenticated
from hotloop.tenants import TenantId

_ID = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")  # no ':' — feedback ids are "<rid>:<choice>:<id>"


class KeyConfigError(ValueError):
    """A key entry cannot be used (start-up error, with the entry's position, never the key)."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def digest_hex(key: str) -> str:
    """The hex sha256 of a key: what the tenant registry stores instead of the key."""
    return hashlib.sha256(key.encode()).hexdigest()


def mint(tenant: TenantId) -> tuple[str, str]:
    """A new (key id, key) for a registry tenant: 256 random bits, and an id naming the tenant
    with 32 random bits of its own (unrelated to the key)."""
    return f"{tenant}-{secrets.token_hex(4)}", "sk-hl-" + secrets.token_urlsafe(32)


def default_id(key: str) -> str:
    """The id of a key given without one: 32 bits of its hash identify it in logs and events
    without revealing it."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def parse_entries(entries: Iterable[tuple[str, str]]) -> dict[bytes, str]:
    """(where, entry) pairs -> {sha256(key): id}. An entry with a ':' is `id:key`."""
    out: dict[bytes, str] = {}
    ids: dict[str, str] = {}
    for where, entry in entries:
        if ":" in entry:
            key_id, key = entry.split(":", 1)
            if not _ID.match(key_id):
                raise KeyConfigError(f"{where}: key id {key_id!r} must be 1-64 of [A-Za-z0-9_.@-]")
        else:
            key_id, key = default_id(entry), entry
        if len(key) < 8 or key != key.strip():
            raise KeyConfigError(f"{where}: a key must be at least 8 characters, without surrounding spaces")
        d = _digest(key)
        if d in out:
            raise KeyConfigError(f"{where}: the same key is listed twice")
        if key_id in ids:
            raise KeyConfigError(f"{where}: key id {key_id!r} is already used by {ids[key_id]}")
        out[d] = key_id
        ids[key_id] = where
    return out


def load_keys(tokens: Iterable[str], tokens_file: str = "") -> dict[bytes, str]:
    """The keys of `[security] user_tokens` and `user_tokens_file` together."""
    entries = [(f"user_tokens[{i}]", t) for i, t in enumerate(tokens)]
    if tokens_file:
        path = Path(tokens_file)
        if not path.is_file():
            raise KeyConfigError(f"user_tokens_file {path} does not exist")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                entries.append((f"{path}:{n}", line))
    return parse_entries(entries)


class KeyRing:
    """The keys this gateway accepts: config keys (fixed) and registry tenants' keys (`put`
    and `drop` by tenant). One event loop reads and writes it. `admin`: the admin API is on
    (an admin token is set), so a gateway with no config keys may start: its users' keys are
    those of the tenants created through it; without it, no key could ever be accepted."""

    def __init__(self, digests: dict[bytes, str], *, admin: bool = False):
        if not digests and not admin:
            raise KeyConfigError(
                "no user API keys configured: set [security] user_tokens or user_tokens_file "
                "(`hotloop up` generates a key file in the run directory), or set [security] "
                "admin_token to create tenants and their keys through the admin API"
            )
        self._config = dict(digests)
        self._tenants: dict[TenantId, dict[bytes, str]] = {}
        self._by_digest = dict(digests)

    def put(self, tenant: TenantId, digests: dict[bytes, str]) -> None:
        """Make `digests` ({sha256: id}) the keys of registry tenant `tenant`, replacing what it
        had. ValueError if one is another's key or key id (nothing is changed then)."""
        others = {d: i for d, i in self._by_digest.items() if d not in self._tenants.get(tenant, {})}
        clash = sorted(i for d, i in digests.items() if d in others) + sorted(
            set(digests.values()) & set(others.values()))
        if clash:
            raise ValueError(f"key(s) {clash} of tenant {tenant!r} are another's key or key id")
        self.drop(tenant)
        self._tenants[tenant] = dict(digests)
        self._by_digest.update(digests)

    def drop(self, tenant: TenantId) -> None:
        """Stop accepting registry tenant `tenant`'s keys (nothing if it has none)."""
        for d in self._tenants.pop(tenant, {}):
            self._by_digest.pop(d, None)

    def __len__(self) -> int:
        return len(self._by_digest)

    def ids(self) -> set[str]:
        """The ids of the keys held."""
        return set(self._by_digest.values())

    def authenticate(self, authorization: str | None) -> str:
        """`Bearer <key>` -> the key's id; else Unauthenticated (the reason names no key)."""
        if not authorization:
            raise Unauthenticated("missing API key: send `Authorization: Bearer <key>`")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("malformed Authorization header: expected `Bearer <key>`")
        key_id = self._by_digest.get(_digest(key.strip()))
        if key_id is None:
            raise Unauthenticated("invalid API key")
        return key_id
