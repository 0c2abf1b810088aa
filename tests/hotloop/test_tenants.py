"""Tenant names, the key id -> tenant map and `[tenants]` in a config file."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from hotloop import config
from hotloop.bus import FEEDBACK_DEAD, feedback_subject
from hotloop.config import ConfigError, TenantConfig
from hotloop.errors import InvalidArgument
from hotloop.tenants import DEFAULT, Directory, InvalidTenant, TenantId

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["acme", "a", "team-7_x", "0day", "x" * 32, ""])
def test_names_a_tenant_may_have(name):
    t = TenantId(name)
    assert t == name and isinstance(t, str) and TenantId.parse(name) == t
    assert t.is_default == (name == "")
    assert TenantId(t) is t  # carried, not checked again
    assert json.loads(json.dumps({t: t})) == {name: name}
    assert repr(t) == repr(name)


@pytest.mark.parametrize("name", ["Acme", "-acme", "_a", "a.b", "a b", "a*", "a>", "x" * 33, "é",
                                  "acme\n", "\nacme", "a/b", "../a", " "])
def test_names_that_cannot_be_a_subject_token_or_a_directory_are_refused(name):
    with pytest.raises(InvalidTenant, match="tenant name"):
        TenantId(name)
    with pytest.raises(ValueError):  # and InvalidArgument: a 400 / INVALID_ARGUMENT at an edge
        TenantId.parse(name)
    with pytest.raises(InvalidArgument):
        TenantId(name)


def test_a_tenant_id_is_built_only_from_a_string():
    with pytest.raises(InvalidTenant, match="a string"):
        TenantId(7)
    assert DEFAULT == "" and DEFAULT.is_default and isinstance(DEFAULT, TenantId)


def test_a_config_field_typed_tenant_id_parses_and_says_why_not():
    class Section(BaseModel):
        tenant: TenantId = DEFAULT
        tenants: dict[TenantId, int] = {}

    s = Section(tenant="acme", tenants={"globex": 1})
    assert type(s.tenant) is TenantId and [type(k) for k in s.tenants] == [TenantId]
    assert s.model_dump() == {"tenant": "acme", "tenants": {"globex": 1}}
    assert s.model_dump_json() == '{"tenant":"acme","tenants":{"globex":1}}'
    with pytest.raises(ValidationError, match=r"tenant\n.*tenant name 'Ac me' must be 1-32"):
        Section(tenant="Ac me")
    with pytest.raises(ValidationError, match="tenant name 'acme\\\\n'"):
        Section(tenants={"acme\n": 1})
    with pytest.raises(ValidationError, match="string"):
        Section(tenant=3)


def test_a_proto_and_a_subject_take_a_tenant_id_as_the_string_it_is():
    from hotloop.proto.v1 import bus_pb2

    msg = bus_pb2.WeightsUpdated(tenant=TenantId("acme"))
    assert bus_pb2.WeightsUpdated.FromString(msg.SerializeToString()).tenant == "acme"
    assert feedback_subject(TenantId("acme")) == "hotloop.feedback.tenant.acme"


PRODUCT = [ROOT / d for d in ("hotloop", "services", "apps", "benchmarks")]
_TENANT_CHARSET = re.compile(r"(?<!Z)a-z0-9")  # the rule's lower-case class, in a pattern


def test_no_module_but_the_type_checks_a_tenant_name():
    """The rule lives in `TenantId` alone: no product module compiles a tenant pattern of its
    own or calls a checking function; a name is parsed into a `TenantId` where it comes in."""
    offenders = []
    for path in sorted(p for d in PRODUCT for p in d.rglob("*.py")):
        if path == ROOT / "hotloop" / "tenants.py" or "proto" in path.parts:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Name | ast.Attribute):
                name = node.id if isinstance(node, ast.Name) else node.attr
                if name == "check_tenant":
                    offenders.append(f"{where}: {name}")
            elif isinstance(node, ast.alias) and node.name == "check_tenant":
                offenders.append(f"{where}: imports {node.name}")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and _TENANT_CHARSET.search(node.value)):
                offenders.append(f"{where}: a tenant pattern {node.value!r}")
    assert offenders == []


def test_the_scan_finds_what_it_forbids(tmp_path):
    """The scan above, on code that breaks the rule, finds it (it can fail)."""
    bad = 'import re\n_T = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")\n'
    found = [n.value for n in ast.walk(ast.parse(bad))
             if isinstance(n, ast.Constant) and isinstance(n.value, str)
             and _TENANT_CHARSET.search(n.value)]
    assert found and not _TENANT_CHARSET.search("^[A-Za-z0-9_.@-]{1,64}$")


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
    with pytest.raises(ConfigError, match=r"\[tenants.Acme\].*tenant name 'Acme' must be"):
        config.load_mesh(config.raw_config(f, environ={}))
    f.write_text('[tenants.acme]\nkeys = ["alice"]\n[tenants.globex]\nkeys = ["alice"]\n')
    with pytest.raises(ConfigError, match=r"'alice' is in tenants 'acme' and 'globex'"):
        config.load_mesh(config.raw_config(f, environ={}))
    f.write_text('[tenants.acme]\nkey = ["alice"]\n')
    with pytest.raises(ConfigError, match=r"\[tenants.acme\] key: Extra inputs"):
        config.load_mesh(config.raw_config(f, environ={}))
