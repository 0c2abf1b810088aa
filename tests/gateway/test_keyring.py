"""The gateway's key ring and directory as the registry changes them (`KeyRing.put/drop`,
`TenantAdmin.apply`), directly: revisions order the changes, config keys and tenants never
move."""

from __future__ import annotations

import hashlib

import pytest

from hotloop.config import TenantConfig
from hotloop.errors import Unauthenticated
from hotloop.tenants import Directory, TenantKey, TenantRecord
from services.gateway.admin import TenantAdmin
from services.gateway.keys import KeyRing, digest_hex, load_keys, mint

CONFIG_KEY = "sk-config-alice-0123"


def ring() -> KeyRing:
    return KeyRing(load_keys([f"alice:{CONFIG_KEY}"]))


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_minted_keys_are_random_and_only_their_digest_is_needed():
    (id1, k1), (id2, k2) = mint("acme"), mint("acme")
    assert id1 != id2 and k1 != k2 and id1.startswith("acme-") and len(k1) > 40
    assert digest_hex(k1) == hashlib.sha256(k1.encode()).hexdigest()
    r = ring()
    r.put("acme", {bytes.fromhex(digest_hex(k1)): id1})
    assert r.authenticate(bearer(k1)) == id1 and r.ids() == {"alice", id1}


def test_a_tenants_keys_are_replaced_and_dropped_but_config_keys_stay():
    r = ring()
    _, k1 = mint("acme")
    _, k2 = mint("acme")
    r.put("acme", {hashlib.sha256(k1.encode()).digest(): "acme-1"})
    r.put("acme", {hashlib.sha256(k2.encode()).digest(): "acme-2"})
    with pytest.raises(Unauthenticated):
        r.authenticate(bearer(k1))
    assert r.authenticate(bearer(k2)) == "acme-2"
    with pytest.raises(ValueError, match="another's"):  # a config key's id
        r.put("globex", {hashlib.sha256(b"x" * 20).digest(): "alice"})
    with pytest.raises(ValueError, match="another's"):  # a config key itself
        r.put("globex", {hashlib.sha256(CONFIG_KEY.encode()).digest(): "g-1"})
    r.drop("acme")
    r.drop("globex")
    with pytest.raises(Unauthenticated):
        r.authenticate(bearer(k2))
    assert r.authenticate(bearer(CONFIG_KEY)) == "alice"


def record(name: str, key: str, key_id: str, revision: int, config: bool = False) -> TenantRecord:
    return TenantRecord(name, (TenantKey(key_id, digest_hex(key)),), 0, 1.0, config, revision)


def test_the_registry_is_applied_in_revision_order_and_never_overrides_config():
    keys, tenants = ring(), Directory({"acme": TenantConfig(keys=["alice"])})
    admin = TenantAdmin(None, keys, tenants)
    _, key = mint("globex")
    admin.apply("globex", record("globex", key, "globex-1", 5), 5)
    assert tenants.tenant_of(keys.authenticate(bearer(key))) == "globex"
    admin.apply("globex", None, 7)  # deleted
    admin.apply("globex", record("globex", key, "globex-1", 5), 5)  # a late, older revision
    with pytest.raises(Unauthenticated):
        keys.authenticate(bearer(key))
    admin.apply("globex", record("globex", key, "globex-1", 9), 9)  # created again
    assert tenants.tenant_of(keys.authenticate(bearer(key))) == "globex"

    _, other = mint("acme")
    admin.apply("acme", record("acme", other, "acme-9", 11), 11)  # a config tenant's name
    admin.apply("initech", record("initech", other, "alice", 12), 12)  # a config key's id
    with pytest.raises(Unauthenticated):
        keys.authenticate(bearer(other))
    assert tenants.tenant_of("alice") == "acme" and tenants.names == ["acme", "globex"]


async def test_an_archive_is_handed_over_only_when_its_size_and_sha256_are_the_announced():
    from hotloop.errors import Unavailable
    from hotloop.proto.v1 import common_pb2
    from services.gateway.admin import _checked

    data = b"archive bytes " * 1000
    info = common_pb2.VersionInfo(version=2, sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))

    async def chunks(payload: bytes):
        for i in range(0, len(payload), 4096):
            yield payload[i:i + 4096]

    x = await _checked("acme", info, chunks(data))
    assert (x.version, x.bytes, b"".join([c async for c in x.chunks()])) == (2, len(data), data)
    flipped = data[:-1] + b"?"
    for bad in (flipped, data[:-1], data + b"!"):
        with pytest.raises(Unavailable, match="does not match|more than"):
            await _checked("acme", info, chunks(bad))
