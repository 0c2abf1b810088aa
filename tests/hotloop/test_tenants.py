"""Tenant names, the key id -> tenant map and `[tenants]` in a config file."""

from __future__ import annotations

import pytest

from hotloop import config
from hotloop.bus import FEEDBACK_DEAD, feedback_subject
from hotloop.config import ConfigError, TenantConfig
from hotloop.tenants import DEFAULT, Directory, check_tenant


@pytest.mark.parametrize("name", ["acme", "a", "team-7_x", "0day", "x" * 32, DEFAULT])
def test_names_a_tenant_may_have(name):
    assert check_tenant(name) == name


@pytest.mark.parametrize("name", ["Acme", "-acme", "_a", "a.b", "a b", "a*", "a>", "x" * 33, "é",
                                  "acme\n"])
def test_names_that_cannot_be_a_subject_token_or_a_directory_are_refused(name):
    with pytest.raises(ValueError, match="tenant name"):
        check_tenant(name)


def test_each_tenant_has_a_feedback_subject_of_its_own():
    subjects = {feedback_subject(t) for t in ("", "acme", "globex", "dead")}
    assert len(subjects) == 4 and FEEDBACK_DEAD not in subjects
    assert feedback_subject() == "hotloop.feedback"
    with pytest.raises(ValueError):
        feedback_subject("a.>")


def test_a_key_id_belongs_to_one_tenant_and_unlisted_ones_to_the_default():
    d = Directory({"acme": TenantConfig(keys=["alice", "carol"]), "globex": TenantConfig(keys=["bob"])})
    assert [d.tenant_of(k) for k in ("alice", "carol", "bob", "dave")] == ["acme", "acme", "globex", DEFAULT]
    assert d.key_ids() == {"alice", "carol", "bob"} and d.names == ["acme", "globex"]
    with pytest.raises(ValueError, match="'bob' is in tenants 'globex' and 'initech'"):
        Directory({"globex": TenantConfig(keys=["bob"]), "initech": TenantConfig(keys=["bob"])})


def test_tenants_in_a_config_file_and_their_errors(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[tenants.acme]\nkeys = ["alice"]\n[tenants.globex]\nkeys = ["bob"]\n')
    mesh = config.load_mesh(config.raw_config(f, environ={}))
    assert Directory(mesh.tenants).tenant_of("bob") == "globex"
    f.write_text('[tenants.Acme]\nkeys = ["alice"]\n')
    with pytest.raises(ConfigError, match=r"tenants: .*tenant name 'Acme'"):
        config.load_mesh(config.raw_config(f, environ={}))
    f.write_text('[tenants.acme]\nkeys = ["alice"]\n[tenants.globex]\nkeys = ["alice"]\n')
    with pytest.raises(ConfigError, match=r"'alice' is in tenants 'acme' and 'globex'"):
        config.load_mesh(config.raw_config(f, environ={}))
    f.write_text('[tenants.acme]\nkey = ["alice"]\n')
    with pytest.raises(ConfigError, match=r"\[tenants.acme\] key: Extra inputs"):
        config.load_mesh(config.raw_config(f, environ={}))
