"""A configuration as a user reads it: every section and key, its value, default, source and
docstring, written as annotated TOML.

Owns: walking the section models (nested sections, tables of entries such as `[tenants.<name>]`),
each key's default and where its value came from (`ConfigTree.sources`: a file, an environment
variable `HOTLOOP__SECTION__KEY`, a `--set`, or the default), and the two renderings
`hotloop config show` prints: `effective` (what a command would run with) and `defaults` (every
key at its default, a file that loads back to the same values). Does not own: which sections
exist (the caller passes the section name -> model table) or how sources are layered and
checked (`hotloop.config`).

A key whose value TOML cannot hold (None), that a section may not set (a `from_mesh` field:
declared once, in a shared section) or that is secret and set (`[security]` tokens) is written
as a commented-out line with a note, so both renderings load back as a config.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
import textwrap
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, TypeAdapter

from hotloop import config
from hotloop.config import ConfigTree, MeshConfig

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_UNSET = object()


def _model(annotation) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _entry_model(annotation) -> type[BaseModel] | None:
    """The model of a table of entries (`dict[str, Model]`), else None."""
    if typing.get_origin(annotation) is dict:
        args = typing.get_args(annotation)
        return _model(args[1]) if len(args) == 2 else None
    return None


def is_secret(field) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("secret"))


def default_of(field) -> Any:
    """The field's default as TOML/JSON data (`_UNSET` for a required field)."""
    if field.is_required():
        return _UNSET
    value = field.get_default(call_default_factory=True)
    return TypeAdapter(field.annotation).dump_python(value, mode="json")


# --- TOML values ---------------------------------------------------------------------------

def toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def toml_value(value: Any) -> str | None:
    """`value` as an inline TOML value; None where TOML has no way to write it (null, or a
    list or table holding one)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)  # repr keeps a float a float ("1.0", "1e-05"): TOML reads both
    if isinstance(value, str):
        # a literal string keeps regexes and Windows paths readable: no escapes inside
        if "\\" in value and "'" not in value and not any(c < " " or c == "\x7f" for c in value):
            return f"'{value}'"
        # JSON's escapes are TOML's; TOML also refuses a raw DEL, which JSON leaves as is
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        items = [toml_value(v) for v in value]
        return None if any(i is None for i in items) else "[" + ", ".join(items) + "]"  # type: ignore[arg-type]
    if isinstance(value, dict):
        items = [(toml_key(str(k)), toml_value(v)) for k, v in value.items()]
        if any(v is None for _, v in items):
            return None
        return "{ " + ", ".join(f"{k} = {v}" for k, v in items) + " }" if items else "{}"
    return None


def _shown(value: Any) -> str:
    """A value in a comment: TOML where TOML can write it."""
    if value is _UNSET:
        return "(required)"
    if value is None:
        return "none"
    text = toml_value(value)
    return text if text is not None else json.dumps(value)


def _doc(model: type[BaseModel], fallback: str | None = "") -> str:
    """A model's own docstring (not a base's), else `fallback`."""
    own = model.__dict__.get("__doc__")
    return inspect.cleandoc(own) if own else (fallback or "")


def _comment(text: str | None) -> list[str]:
    return [f"# {line}".rstrip() for line in (text or "").strip().splitlines()]


# --- sources -------------------------------------------------------------------------------

def source_of(tree: ConfigTree | None, dotted: str, *, secret: bool = False) -> str:
    """Where the value at `dotted` came from: its own source, or the sources of the keys below
    it (a table given key by key), last (winning) first; "default" when none gave it.
    Unlike `ConfigTree.source`, an enclosing table's source does not count: `[rollout]` in a
    file does not make every key of `[rollout]` the file's. With `secret`, a `--set` is named
    without its value."""
    if tree is None:
        return "default"
    found = {src for key, src in tree.sources.items() if key == dotted or key.startswith(dotted + ".")}
    rank = {"--set": 0, "environment": 1}  # what raw_config layers last wins
    if secret:
        found = {re.sub(r"^(--set [^=]*)=.*", r"\1=...", src, flags=re.S) for src in found}
    order = sorted(found, key=lambda src: (rank.get(src.split(" ", 1)[0], 2), src))
    return ", ".join(order) or "default"


# --- rendering -----------------------------------------------------------------------------

class _Writer:
    """Annotated TOML of one configuration, table by table (`values`: the table's values as
    JSON data). `tree`: where each value came from (None: every value is the default);
    `effective`: each key also says its default and source."""

    def __init__(self, tree: ConfigTree | None, effective: bool):
        self.tree = tree
        self.effective = effective
        self.lines: list[str] = []

    def table(self, path: list[str], model: type[BaseModel], values: Mapping[str, Any], doc: str = "",
              roots: Mapping[str, type[BaseModel]] | None = None) -> None:
        """The keys of `model` at `path` (its header first, unless it is the root), then its
        nested tables, which TOML requires after every plain key of the table; at the root,
        then `roots`, the sections besides the shared ones."""
        if path:
            self.lines += ["", *_comment(doc), f"[{'.'.join(toml_key(p) for p in path)}]"]
        later: list[tuple[str, Any]] = []
        for name, field in model.model_fields.items():
            nested, entries = _model(field.annotation), _entry_model(field.annotation)
            value = values.get(name)
            if (nested and isinstance(value, dict)) or (entries and isinstance(value, dict)):
                later.append((name, field))
            else:
                self.key(path, name, field, value)
        for name, field in later:
            self.subtable(path, name, field, values[name])
        for name, sub in (roots or {}).items():
            self.table([name], sub, values.get(name, {}), _doc(sub))

    def subtable(self, path: list[str], name: str, field, value: dict) -> None:
        nested, entries = _model(field.annotation), _entry_model(field.annotation)
        if nested:
            self.table([*path, name], nested, value, _doc(nested, field.description))
            return
        assert entries is not None
        where = ".".join(toml_key(p) for p in [*path, name])
        keys = ", ".join(f"{k} = {_shown(default_of(f))}" for k, f in entries.model_fields.items())
        self.lines += ["", *_comment(field.description), *_comment(textwrap.fill(
            f"One table [{where}.<name>] each: {keys} (documented in "
            f"{entries.__module__.replace('.', '/')}.py, {entries.__name__}).", 94))]
        if self.effective:
            self.lines.append(f"# source: {source_of(self.tree, where)}")
        if not value:
            self.lines.append("# (none)")
        for entry, entry_values in value.items():
            self.table([*path, name, str(entry)], entries, entry_values, "")

    def key(self, path: list[str], name: str, field, value: Any) -> None:
        dotted = ".".join([*path, name])
        default = default_of(field)
        self.lines += ["", *_comment(field.description)]
        mesh = config.mesh_path(field)
        if self.effective:
            origin = source_of(self.tree, mesh or dotted, secret=is_secret(field))
            self.lines.append(f"# default: {_shown(default)} | source: {origin}")
        text = toml_value(value)
        if mesh:
            note = f"declared once, as [{mesh.rsplit('.', 1)[0]}] {mesh.rsplit('.', 1)[1]}: set it there"
        elif self.effective and is_secret(field) and value != default:
            note, text = "secret: set, not shown", "..."
        elif text is None:
            if value is None:
                note, text = "None (unset); TOML has no null: write a value to set it", "..."
            else:
                note, text = "TOML cannot write this value", _shown(value)
        else:
            self.lines.append(f"{toml_key(name)} = {text}")
            return
        self.lines.append(f"# {toml_key(name)} = {text}    # {note}")


def _render(sections: Mapping[str, type[BaseModel]], values: Mapping[str, Any], tree: ConfigTree | None,
            effective: bool, head: str) -> str:
    writer = _Writer(tree, effective)
    writer.lines += _comment(head)
    writer.table([], MeshConfig, values, roots=sections)
    return "\n".join(writer.lines).lstrip("\n") + "\n"


def defaults(sections: Mapping[str, type[BaseModel]]) -> str:
    """Every shared section and each of `sections`, every key at its default with its
    docstring above it, as a TOML file that loads back to the same values. Sections in a
    stable order: the shared ones as `MeshConfig` declares them, then `sections`' order."""
    values: dict[str, Any] = MeshConfig().model_dump(mode="json")
    for name, model in sections.items():
        values[name] = model().model_dump(mode="json")
    return _render(sections, values, None, False,
                   "Every key of a hotloop config at its default (`hotloop config show --defaults`).\n"
                   "Precedence, lowest first: these defaults < this file < HOTLOOP__SECTION__KEY\n"
                   "environment variables < --set section.key=value.")


def effective(sections: Mapping[str, type[BaseModel]], path: str | os.PathLike | None = None,
              overrides: list[str] | None = None, environ: dict[str, str] | None = None) -> str:
    """The configuration a command would run with, from the file at `path`, the environment
    and `overrides`: every key with its value, default, source and docstring. Every problem
    of every section is a `ConfigError`, as when a command loads it."""
    tree = config.raw_config(path, overrides, environ)
    mesh, loaded = config.load_sections(tree, sections)
    values: dict[str, Any] = mesh.model_dump(mode="json")
    for name, section in loaded.items():
        values[name] = section.model_dump(mode="json")
    given = f"{path}" if path else "no file"
    return _render(sections, values, tree, True,
                   f"The effective hotloop config ({given}, the environment, --set).\n"
                   "Each key: its docstring, then its default and the source of its value\n"
                   "(the file, an environment variable, a --set, or the default).")
