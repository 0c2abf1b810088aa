"""`hotloop config show`: the effective configuration key by key (value, default, source,
docstring) as TOML that loads back, and `--defaults`, a complete config file at the defaults."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from launch import sections
from apps.cli import main
from hotloop import configdoc
from hotloop.config import ConfigError, load_sections, raw_config

ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted([*ROOT.glob("configs/**/*.toml"), *ROOT.glob("deploy/**/*.toml")])


def hotloop(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apps.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **(env or {})})


def values(path: str | Path | None, overrides: list[str] | None = None,
           environ: dict[str, str] | None = None) -> dict:
    """Every section's validated values, as JSON data."""
    mesh, loaded = load_sections(raw_config(path, overrides, environ or {}), sections.sections())
    return {"mesh": mesh.model_dump(mode="json"),
            **{name: section.model_dump(mode="json") for name, section in loaded.items()}}


def key_block(text: str, table: str, key: str) -> str:
    """The lines that document and set `key` in `[table]` of a `config show` output."""
    header = f"[{table}]\n" if table else ""
    start = text.index(header) + len(header) if header else 0
    end = text.find("\n[", start)
    body = text[start:end if end >= 0 else len(text)]
    blocks = [b for b in body.split("\n\n") if re.search(rf"^(# )?{re.escape(key)} = ", b, re.M)]
    assert len(blocks) == 1, (table, key, blocks)
    return blocks[0]


def test_defaults_round_trip_through_the_command_line(tmp_path):
    out = hotloop("config", "show", "--defaults")
    assert out.returncode == 0, out.stderr
    f = tmp_path / "defaults.toml"
    f.write_text(out.stdout)
    again = hotloop("config", "show", "--config", str(f))
    assert again.returncode == 0, again.stderr
    assert values(f) == values(None)
    # every section is in it, in a stable order: the shared ones, then the services' and jobs'
    headers = re.findall(r"^\[([a-z_]+)\]$", out.stdout, re.M)
    assert headers == ["model", "nats", "telemetry", "security", "grpc", "endpoints",
                       *sections.sections()], headers
    assert out.stdout == hotloop("config", "show", "--defaults").stdout


def test_defaults_document_every_key_and_comment_out_what_a_file_cannot_set():
    text = configdoc.defaults(sections.sections())
    loaded = tomllib.loads(text)
    # a key with a docstring above it, at its default
    block = key_block(text, "rollout", "port")
    assert block.splitlines() == ["# Port to listen on; 0 picks a free one (written to the port file).",
                                  "port = 0"]
    assert loaded["trainer"]["loss"]["clip_eps_low"] == 0.2
    # None has no TOML: commented out, with a note
    assert "# ray_num_cpus = ...    # None (unset)" in key_block(text, "reward", "ray_num_cpus")
    assert "ray_num_cpus" not in loaded["reward"]
    # declared once in [model]: writing it in [trainer] would be an error
    assert "declared once, as [model] dtype" in key_block(text, "trainer", "dtype")
    assert "dtype" not in loaded["trainer"] and loaded["model"]["dtype"] == "auto"
    # a table of entries: its default entries as tables, and what an entry holds
    assert loaded["reward"]["rules"]["format"]["match_reward"] == 1.0
    assert "One table [tenants.<name>] each: keys = [], trainer = \"\"" in text


def test_sources_of_a_file_an_environment_variable_and_a_set(tmp_path, monkeypatch, capsys):
    f = tmp_path / "c.toml"
    f.write_text('[rollout]\nport = 50051\n[trainer.loss]\nkl_beta = 0.1\n[model]\nname = "tiny"\n')
    monkeypatch.setenv("HOTLOOP__NATS__URL", "nats://127.0.0.1:4222")
    monkeypatch.setenv("HOTLOOP__ROLLOUT__MAX_N", "4")
    assert main(["config", "show", "--config", str(f), "--set", "trainer.seed=7",
                 "--set", "rollout.max_n=5"]) == 0
    text = capsys.readouterr().out
    assert key_block(text, "rollout", "port").endswith(f"# default: 0 | source: {f}\nport = 50051")
    assert key_block(text, "trainer.loss", "kl_beta").endswith(f"source: {f}\nkl_beta = 0.1")
    assert key_block(text, "nats", "url").endswith(
        '# default: "" | source: environment HOTLOOP__NATS__URL\nurl = "nats://127.0.0.1:4222"')
    assert key_block(text, "trainer", "seed").endswith("# default: 0 | source: --set trainer.seed=7\nseed = 7")
    # the environment and a --set on one key: the --set wins, and is what is shown
    assert key_block(text, "rollout", "max_n").endswith("source: --set rollout.max_n=5\nmax_n = 5")
    # a key no source gave, in a table the file does give
    assert key_block(text, "rollout", "host").endswith('source: default\nhost = "127.0.0.1"')
    # a key declared once: shown where it is read, with the source of the shared key
    assert key_block(text, "trainer", "model").endswith(
        f'source: {f}\n# model = "tiny"    # declared once, as [model] name: set it there')
    # docstrings come with each key
    assert "Coefficient of the KL term" in key_block(text, "trainer.loss", "kl_beta")
    # and the effective output is itself a config that loads to the same values
    shown = tmp_path / "shown.toml"
    shown.write_text(text)
    environ = {"HOTLOOP__NATS__URL": "nats://127.0.0.1:4222", "HOTLOOP__ROLLOUT__MAX_N": "4"}
    assert values(shown) == values(f, ["trainer.seed=7", "rollout.max_n=5"], environ)


def test_secrets_are_said_to_be_set_never_shown(tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_text('[security]\nadmin_token = "s3cr3t-admin"\n')
    assert main(["config", "show", "--config", str(f), "--set", 'security.user_tokens=["u:s3cr3t-user"]']) == 0
    text = capsys.readouterr().out
    assert "s3cr3t" not in text
    assert "# admin_token = ...    # secret: set, not shown" in key_block(text, "security", "admin_token")
    assert "source: --set security.user_tokens=...\n" in key_block(text, "security", "user_tokens")


def test_a_bad_key_or_value_is_the_usual_error_and_exit_2(tmp_path):
    r = hotloop("config", "show", "--set", "rollout.prot=1")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--set rollout.prot=1: [rollout] prot: unknown key; did you mean 'port'?" in r.stderr
    r = hotloop("config", "show", env={"HOTLOOP__TRAINER__SEED": "seven"})
    assert r.returncode == 2 and "environment HOTLOOP__TRAINER__SEED: [trainer] seed:" in r.stderr
    r = hotloop("config", "show", "--defaults", "--set", "rollout.port=1")
    assert r.returncode == 2 and "--defaults prints the defaults alone" in r.stderr


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_config_file_parses_and_shows_as_itself(path, tmp_path):
    text = configdoc.effective(sections.sections(), path, [], {})
    shown = tmp_path / "shown.toml"
    shown.write_text(text)
    assert values(shown) == values(path)


def test_there_are_shipped_config_files():
    names = {p.relative_to(ROOT).as_posix() for p in CONFIG_FILES}
    assert {"configs/demo.toml", "deploy/k8s/hotloop.toml"} <= names


@pytest.mark.parametrize("value", [
    "plain", 'say "hi"', "back\\slash", "it's \\d", "two\nlines\ttab", "ünï\u00e9", "\x7f\x01",
    0, -3, 10**18, 1.0, 1e-05, -2.5e300, True, False, [], [1, "a"], {}, {"a b": 1, "c": [True]},
    {"python:m:f": 0.5},
])
def test_toml_value_reads_back_as_the_same_value(value):
    text = configdoc.toml_value(value)
    assert text is not None
    assert tomllib.loads(f"x = {text}")["x"] == value


def test_toml_value_writes_nonfinite_floats_and_refuses_null():
    assert math.isinf(tomllib.loads(f"x = {configdoc.toml_value(float('-inf'))}")["x"])
    assert math.isnan(tomllib.loads(f"x = {configdoc.toml_value(float('nan'))}")["x"])
    assert configdoc.toml_value(None) is None
    assert configdoc.toml_value([1, None]) is None
    assert configdoc.toml_value({"a": None}) is None


def test_a_config_error_from_effective_names_every_problem():
    with pytest.raises(ConfigError) as e:
        configdoc.effective(sections.sections(), None, ["rollout.port=x", "rewrd.port=1"], {})
    assert len(e.value.problems) == 2
