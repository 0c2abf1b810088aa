"""Typed configuration: one TOML file, environment overrides, CLI overrides.

Owns: the sections every process shares (model, NATS, telemetry, security, run directory,
service endpoints) and the loader that layers sources. Each service defines its own section
model next to its code (`services/<name>/config.py`) and loads it with `load_section`.

Precedence, lowest first: field defaults < TOML file < environment < `--set key=value`.
Environment keys are `HOTLOOP__<SECTION>__<FIELD>` (double underscores separate levels),
e.g. `HOTLOOP__ROLLOUT__PORT=50051`. CLI overrides use dotted paths: `--set rollout.port=50051`.
Lists, tables and null are read as JSON; any other value is text that the field's own type
parses (`3` for a number, `true` for a flag, `3` for a string stays "3").
Every problem of every section is reported at once (`ConfigError`), naming the file, variable
or `--set` that gave the value, the section and the key, and the nearest valid key for a typo.
"""

from __future__ import annotations

import difflib
import json
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from hotloop.hardware import Dtype
from hotloop.tenants import TenantId

ENV_PREFIX = "HOTLOOP__"


def from_mesh(path: str, default: Any) -> Any:
    """A field of a service's section that is declared once, in a shared section (`path`,
    e.g. "model.dtype"): the loader fills it from there, and setting it in the service's own
    section is an error. Standalone (tests, benchmarks) the field is an ordinary one."""
    return Field(default, json_schema_extra={"from_mesh": path})


def secret(default: Any) -> Any:
    """A field whose value is a credential: `hotloop config show` says whether it is set,
    never what it is."""
    return Field(default, json_schema_extra={"secret": True})


def mesh_path(field) -> str:
    """The shared key a `from_mesh` field is declared as ("model.dtype"); "" for any other."""
    extra = field.json_schema_extra
    return extra.get("from_mesh", "") if isinstance(extra, dict) else ""


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_default=True, use_attribute_docstrings=True)


class ServiceSection(Section):
    """Base of a service process's own section: what every service's runner reads from it."""

    metrics_port: int = Field(0, ge=-1, le=65535)
    """Port of the process's Prometheus endpoint (`GET /metrics` on the section's `host`);
    0 picks a free one (the port file says which, as `metrics_port`); -1 serves none."""


class ModelConfig(Section):
    """The base model, declared once for every process that holds a copy of it."""

    name: str = "smollm2-135m-instruct"
    """Base model: a known name (`hotloop models list`), a local HF directory, or a hub id.
    The rollout serves it, the trainer trains LoRA on it, the reference scores with it."""
    dtype: Dtype = "auto"
    """Dtype of every copy of the base model: the rollout engine's weights, the trainer's and
    the reference's compute (the KL compares the two, so they must agree). `auto`: bf16 where
    the hardware computes it fast (CUDA, AMX-BF16 CPUs; measured), else fp32
    (`hotloop.hardware`)."""
    max_model_len: int = Field(2048, ge=64, le=131072)
    """Longest prompt + completion, in tokens, that any service accepts."""


class NatsConfig(Section):
    """The message bus: version announcements, feedback, traffic, the versions KV."""

    url: str = ""
    """NATS server URL, or the servers of one cluster comma-separated
    (`nats://n1:4222,nats://n2:4222,nats://n3:4222`): the client connects to any of them and
    fails over to the others. Empty: no bus (services run, nothing is announced)."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """Give up connecting after this long (bounded retry with backoff inside)."""
    ping_interval_s: float = Field(10.0, gt=0)
    """A client pings its server this often; three unanswered in a row and it counts the
    connection lost and reconnects (to another server of a cluster). What finds a server that
    froze (stopped, its host cut off) with the TCP connection still open: at nats-py's
    default, 120 s, a client stayed on such a server for about 6 minutes, every JetStream
    request timing out. At 10 s it leaves within ~30 s."""
    replicas: int = Field(1, ge=1, le=5)
    """Copies JetStream keeps of each stream and KV bucket hotloop creates (feedback, traffic,
    dead letters, the versions KV). 1 on a single server; 3 on a cluster of three, which then
    loses nothing when one server dies. A service that ensures the streams brings existing
    ones to this count; a single server refuses more than 1 (the error says so)."""

    @field_validator("url")
    @classmethod
    def _servers(cls, url: str) -> str:
        parts = [p.strip() for p in url.split(",")]
        if url.strip() and not all(parts):
            raise ValueError(f"empty server in {url!r} (comma-separated NATS URLs)")
        return ",".join(parts) if url.strip() else ""


class TelemetryConfig(Section):
    """Where each process's trace spans go."""

    exporter: Literal["none", "jsonl", "otlp", "memory"] = "none"
    """Where spans go: a JSON-lines file (local runs), an OTLP endpoint, memory (tests), or nowhere."""
    jsonl_path: str = ""
    """File for the `jsonl` exporter; empty: `<run_dir>/traces/<service>.jsonl`."""
    otlp_endpoint: str = "http://127.0.0.1:4317"
    """OTLP/gRPC endpoint for the `otlp` exporter."""


class GrpcConfig(Section):
    """How every gRPC client of a process finds out that the server at the other end stopped
    answering without closing its connection: a replica's process frozen (stopped, swapping,
    a deadlock below Python), its host gone or cut off by the network. Without this a call to
    it waits until the kernel gives up on the TCP connection (~15 minutes on Linux); a
    balanced client's chunk, a user's stream and a weight push with it. With it the call fails
    with UNAVAILABLE after at most `keepalive_s + keepalive_timeout_s`, so the balanced
    clients move its work to the other replicas and the gateway routes the user elsewhere;
    a retry that reconnects waits up to `connect_timeout_s` more for the handshake. Every
    server accepts the pings (down to one every 0.5 s) and pings its own clients the same way:
    a frozen client's calls end after the same bound, so their handlers stop waiting on
    streams nobody reads."""

    keepalive_s: float = Field(10.0, ge=0)
    """While a call is open, a client pings the server when nothing came from it for this
    long (HTTP/2 PING; free on a healthy connection). 0: no pings (gRPC's default)."""
    keepalive_timeout_s: float = Field(10.0, gt=0)
    """A ping not acknowledged within this ends the connection and fails its calls with
    UNAVAILABLE."""
    connect_timeout_s: float = Field(20.0, gt=0)
    """The longest one connection attempt (TCP and HTTP/2 handshake) may take; gRPC's
    default, 20 s. A frozen process's kernel still accepts the TCP connection, so a
    reconnect to it waits this long before the call fails."""

    @field_validator("keepalive_s")
    @classmethod
    def _ping_rate(cls, s: float) -> float:
        if 0 < s < 1:  # the servers refuse pings closer than 0.5 s (ENHANCE_YOUR_CALM)
            raise ValueError(f"{s:g}: ping at most once a second (or 0: never)")
        return s


class SecurityConfig(Section):
    """Who may call what: the admin token and the users' API keys."""

    admin_token: str = secret("")
    """Bearer token required on admin RPCs (PushAdapter). Empty: admin RPCs are refused.
    Surrounding whitespace is dropped: a token from a file (a Kubernetes Secret, `openssl rand
    -hex 24 > file`) ends in a newline, which gRPC metadata cannot carry."""
    user_tokens: list[str] = secret([])
    """API keys the gateway accepts for user traffic, each `key` or `id:key`. The id (given, or
    `key-` + the first 8 hex digits of the key's sha256) is what traffic and feedback record,
    never the key. With no keys here nor in `user_tokens_file`, the gateway refuses to start
    unless `admin_token` is set: its users are then the tenants created through the admin API."""
    user_tokens_file: str = ""
    """A file of further API keys, one per line as above (blank lines and `#` comments are
    skipped). `hotloop up` generates one in the run directory (mode 0600)."""

    @field_validator("admin_token")
    @classmethod
    def _strip(cls, token: str) -> str:
        return token.strip()


Replicas = Annotated[list[Annotated[str, Field(min_length=1)]], BeforeValidator(
    lambda v: ([v] if v else []) if isinstance(v, str) else v)]
"""A service's replicas: a list of gRPC targets, or one target as a string (configs and
environment overrides written for one replica). A target is `host:port`, or `dns:///name:port`
for a name that resolves to several addresses, which gRPC balances call by call
(`grpcutil.channel`)."""


class Endpoints(Section):
    """Where each service listens, as gRPC targets. `hotloop up` fills these in."""

    rollout: Replicas = []
    """Rollout replicas; the trainer pushes every version to each of them, and a training
    job spreads its generation over them (`hotloop.replicas`). An entry `dns:///host:port`
    names replicas by DNS (a compose service scaled with `--scale`, a Kubernetes headless
    Service): the gateway routes to every address it resolves to and resolves it again as
    replicas come and go; a trainer's gRPC channel reaches one of them, and the others catch
    up on their own from the version announcement."""
    reward: Replicas = []
    """Reward replicas; a job spreads its scoring over them."""
    reference: Replicas = []
    """Reference replicas; a job spreads its reference passes over them."""
    trainer: str = ""
    """The trainer's FetchAdapter target (`host:port`) as the other processes reach it (a
    compose service name, a Kubernetes Service): where a restarted rollout replica and the
    gateway's admin API fetch stored versions from, and the address the trainer announces.
    Empty: the address each announcement names."""
    gateway: str = ""
    """The gateway's gRPC target; `hotloop up` records it for the clients of a local run."""

    @field_validator("rollout", "reward", "reference")
    @classmethod
    def _once_each(cls, targets: list[str]) -> list[str]:
        twice = sorted({t for t in targets if targets.count(t) > 1})
        if twice:  # one replica listed twice would get twice the share of every batch
            raise ValueError(f"{', '.join(twice)} listed more than once")
        return targets


class TenantConfig(Section):
    """One tenant: a set of users, served and trained on an adapter lineage of its own."""

    keys: list[Annotated[str, Field(min_length=1)]] = []
    """Ids of the tenant's API keys (the `id` of `[security] user_tokens` / `user_tokens_file`
    entries `id:key`). A request with one of them is served by this tenant's newest adapter
    version (the base model while it has none), and its traffic and feedback carry the
    tenant's name. A key id in no tenant belongs to the default tenant ("")."""
    trainer: str = ""
    """The FetchAdapter address (`host:port`) of the trainer of this tenant's lineage (its
    `[online] tenant` process): where a rollout replica that restarted fetches the tenant's
    latest version, asked before `[endpoints] trainer`. Empty: `[endpoints] trainer`, then the
    address the tenant's last announcement named, heard or recorded in the versions KV with
    the version (a trainer announces again when it starts)."""


def _tenants(tenants: dict[TenantId, TenantConfig]) -> dict[TenantId, TenantConfig]:
    from hotloop.tenants import Directory

    Directory(tenants)  # a key id in two tenants is refused (the names are TenantIds already)
    return tenants


class MeshConfig(Section):
    """The sections every process reads."""

    model: ModelConfig = ModelConfig()
    """`[model]`: the base model every process holds a copy of."""
    nats: NatsConfig = NatsConfig()
    """`[nats]`: the message bus (announcements, feedback, traffic)."""
    telemetry: TelemetryConfig = TelemetryConfig()
    """`[telemetry]`: where trace spans go."""
    security: SecurityConfig = SecurityConfig()
    """`[security]`: the admin token and the users' API keys."""
    grpc: GrpcConfig = GrpcConfig()
    """`[grpc]`: how a client finds out that a server stopped answering."""
    endpoints: Endpoints = Endpoints()
    """`[endpoints]`: where each service listens."""
    tenants: Annotated[dict[TenantId, TenantConfig], AfterValidator(_tenants)] = {}
    """`[tenants.<name>]`: the tenants and their users' key ids. None: every user is in the
    default tenant, as before tenants existed."""
    run_dir: str = ".hotloop/run"
    """Logs, traces, port files and the NATS store of a local run live here."""


S = TypeVar("S", bound=BaseModel)


class ConfigError(ValueError):
    """Every problem of a configuration at once, each naming its source, section and key.

    `str()` is what a user reads: one line per problem, no traceback needed. Commands print it
    and exit with status 2."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(self._text())

    def _text(self) -> str:
        head = "1 configuration error" if len(self.problems) == 1 else f"{len(self.problems)} configuration errors"
        return head + ":\n" + "\n".join(f"  - {p}" for p in self.problems)


class ConfigTree(dict):
    """The merged configuration, and where each value came from: `sources["grpo.seed"]` is
    the file, the environment variable or the `--set` that gave it (the last one wins)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sources: dict[str, str] = {}

    def source(self, dotted: str) -> str:
        """Where `dotted` came from: its own source, the nearest enclosing key's, or (for a
        section given only through keys below it) the first of those keys'."""
        parts = dotted.split(".")
        for n in range(len(parts), 0, -1):
            found = self.sources.get(".".join(parts[:n]))
            if found:
                return found
        below = next((src for key, src in self.sources.items() if key.startswith(dotted + ".")), "")
        return below or "defaults"


def _parse_value(raw: str) -> Any:
    """Lists, tables, null and quoted strings from JSON (`--set x='"1"'` is the text 1, as in
    TOML); everything else stays text for the field's own type to parse (pydantic reads "3" as
    an int field's 3, and a string field keeps "3")."""
    text = raw.strip()
    if text == "null" or text[:1] in ("[", "{", '"'):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            pass
    return raw


def _set_path(tree: ConfigTree, dotted: str, value: Any, source: str) -> str | None:
    """Set `dotted` to `value`; the problem, if the path runs through a value."""
    parts = dotted.split(".")
    node: dict = tree
    for i, p in enumerate(parts[:-1]):
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            return f"{source}: cannot set {dotted!r}: {'.'.join(parts[:i + 1])!r} is a value, not a section"
    node[parts[-1]] = value
    _record(tree, dotted, value, source)
    return None


def _record(tree: ConfigTree, dotted: str, value: Any, source: str) -> None:
    tree.sources[dotted] = source
    if isinstance(value, dict):
        for k, v in value.items():
            _record(tree, f"{dotted}.{k}", v, source)


def raw_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    environ: dict[str, str] | None = None,
) -> ConfigTree:
    """Merge the file, the environment and the overrides into one nested dict, remembering
    each value's source. A missing or malformed file, or a malformed override, is a
    `ConfigError` (all of them at once)."""
    tree = ConfigTree()
    problems: list[str] = []
    if path:
        p = Path(path)
        try:
            with open(p, "rb") as f:
                loaded = tomllib.load(f)
        except FileNotFoundError:
            problems.append(f"{p}: the config file does not exist")
        except tomllib.TOMLDecodeError as e:
            problems.append(f"{p}: not valid TOML: {e}")
        except OSError as e:
            problems.append(f"{p}: cannot be read: {e.strerror}")
        else:
            tree.update(loaded)
            for k, v in loaded.items():
                _record(tree, k, v, str(p))
    env = os.environ if environ is None else environ
    for key, raw in sorted(env.items()):
        if key.startswith(ENV_PREFIX):
            dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
            problem = _set_path(tree, dotted, _parse_value(raw), f"environment {key}")
            problems += [problem] if problem else []
    for item in overrides or []:
        if "=" not in item:
            problems.append(f"--set {item}: an override is key=value, e.g. --set rollout.port=50051")
            continue
        k, v = item.split("=", 1)
        problem = _set_path(tree, k.strip(), _parse_value(v), f"--set {item}")
        problems += [problem] if problem else []
    if problems:
        raise ConfigError(problems)
    return tree


def _fields_at(model: type[BaseModel], path: tuple) -> list[str]:
    """The field names a key at `path` (below `model`) could have meant."""
    for part in path:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _paths(model: type[BaseModel], prefix: str = "", depth: int = 3) -> list[str]:
    """Every field of `model` as a dotted path (nested sections included)."""
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        ann = field.annotation
        if depth > 1 and isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _paths(ann, f"{prefix}{name}.", depth - 1)
    return out


def _unknown_key(section: str, model: type[BaseModel], loc: tuple, others: Mapping[str, type[BaseModel]]) -> str:
    """`unknown key` with the nearest valid key: in the same place, else anywhere."""
    name = str(loc[-1])
    near = difflib.get_close_matches(name, _fields_at(model, loc[:-1]), n=1)
    if near:
        return f"unknown key; did you mean {near[0]!r}?"
    elsewhere = {f"[{sec}] {path}": path.rsplit(".", 1)[-1]
                 for sec, m in others.items() for path in _paths(m)}
    hits = [where for where, leaf in elsewhere.items() if difflib.get_close_matches(name, [leaf], n=1, cutoff=0.8)]
    if hits:
        return f"unknown key; did you mean {hits[0]}?"
    return (f"unknown key (the keys of [{section}] are documented in {model.__module__.replace('.', '/')}.py; "
            f"`hotloop config show --defaults` lists every key)")


def _problems(tree: ConfigTree, section: str, model: type[BaseModel], errors: list[dict],
              others: Mapping[str, type[BaseModel]] = {}) -> list[str]:
    """Pydantic's errors of one section, each as `<source>: [section] key: what is wrong`."""
    out = []
    for e in errors:
        loc = tuple(e["loc"])
        key = ".".join(str(x) for x in loc)
        where = f"[{section}] {key}" if key else f"[{section}]"
        source = tree.source(f"{section}.{key}" if key else section)
        if e["type"] == "extra_forbidden":
            out.append(f"{source}: {where}: {_unknown_key(section, model, loc, others)}")
        elif e["type"] == "missing":
            out.append(f"{source}: {where}: required, and not given")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, dict) else f" (got {got!r})"
            out.append(f"{source}: {where}: {e['msg']}{shown}")
    return out


def load_sections(
    tree: ConfigTree, sections: Mapping[str, type[BaseModel]], *, only_known: bool = True
) -> tuple[MeshConfig, dict[str, BaseModel]]:
    """The shared sections and each of `sections`, validated together: every problem of
    every section is reported at once (`ConfigError`). With `only_known`, a top-level section
    that is neither shared nor in `sections` is a problem too (a typo such as `[trainr]`)."""
    problems: list[str] = []
    shared = {k: v for k, v in tree.items() if k in MeshConfig.model_fields}
    shared_sections = {k: f.annotation for k, f in MeshConfig.model_fields.items()
                       if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}
    everything = {**shared_sections, **sections}
    mesh = None
    try:
        mesh = MeshConfig.model_validate(shared)
    except ValidationError as e:
        for err in e.errors(include_url=False):
            name = str(err["loc"][0])
            if name in shared_sections:
                problems += _problems(tree, name, shared_sections[name], [{**err, "loc": err["loc"][1:]}],
                                      everything)
            else:  # a top-level value such as run_dir, or a table of tables such as [tenants]
                where = [str(p) for p in err["loc"]]
                at = f"[{'.'.join(where[:-1])}] {where[-1]}" if len(where) > 1 else name
                problems.append(f"{tree.source('.'.join(where))}: {at}: {err['msg']} "
                                f"(got {err.get('input')!r})")
    loaded: dict[str, BaseModel] = {}
    for name, model in sections.items():
        values, moved = _inherit(tree, name, model, mesh)
        problems += moved
        try:
            loaded[name] = model.model_validate(values)
        except ValidationError as e:
            problems += _problems(tree, name, model, e.errors(include_url=False), everything)
    if only_known:
        known = set(MeshConfig.model_fields) | set(sections)
        for name, value in tree.items():
            if name in known:
                continue
            near = difflib.get_close_matches(name, sorted(known), n=1)
            kind = "section" if isinstance(value, dict) else "key"
            hint = f"; did you mean [{near[0]}]?" if near else f"; known sections: {', '.join(sorted(known))}"
            problems.append(f"{tree.source(name)}: unknown {kind} {name!r}{hint}")
    if problems:
        raise ConfigError(problems)
    assert mesh is not None
    return mesh, loaded


def _inherit(tree: ConfigTree, name: str, model: type[BaseModel], mesh: MeshConfig | None
             ) -> tuple[dict, list[str]]:
    """The section's values with its `from_mesh` fields filled from the shared sections, and
    a problem for each such field the section sets itself."""
    values = dict(tree.get(name, {})) if isinstance(tree.get(name, {}), dict) else tree.get(name)
    problems = []
    for key, field in model.model_fields.items():
        path = mesh_path(field)
        if not path or not isinstance(values, dict):
            continue
        if key in values:
            problems.append(f"{tree.source(f'{name}.{key}')}: [{name}] {key}: declared once, as "
                            f"{path}; remove it here (every service takes it from there)")
            values.pop(key)
        if mesh is not None:
            node: Any = mesh
            for part in path.split("."):
                node = getattr(node, part)
            values[key] = node
    return values, problems


def load_mesh(tree: dict) -> MeshConfig:
    """The shared sections alone (other sections of the file are not looked at)."""
    return load_sections(_as_tree(tree), {}, only_known=False)[0]


def load_section(tree: dict, name: str, model: type[S]) -> S:
    """One section (with what it takes from the shared ones); its problems as a `ConfigError`."""
    return load_sections(_as_tree(tree), {name: model}, only_known=False)[1][name]  # type: ignore[return-value]


def _as_tree(tree: dict) -> ConfigTree:
    return tree if isinstance(tree, ConfigTree) else ConfigTree(tree)


def load(
    section: str,
    model: type[S],
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
) -> tuple[MeshConfig, S]:
    """Load the shared sections and one service's section from all sources (the other
    sections of the file belong to other processes and are not checked here)."""
    tree = raw_config(path, overrides)
    mesh, loaded = load_sections(tree, {section: model}, only_known=False)
    return mesh, loaded[section]  # type: ignore[return-value]
