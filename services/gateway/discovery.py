"""Finding the rollout replicas behind `[endpoints] rollout`.

Owns: expanding each entry into replica addresses, `dns:///host:port` into every address the
name resolves to (a compose service scaled with `--scale rollout=N`, a Kubernetes headless
Service) and anything else as written; resolving those names again every `interval_s`; and
handing the router the current set (`Router.update`), one `Replica` per address, kept while
its address stays. A name that no longer exists (no replica up, or none ready) yields no
address; a lookup that fails otherwise (DNS briefly away) keeps what the name had, and says so.
Does not own: health (the router polls every replica it is given, so an address that resolves
but does not serve gets no user) or the wire (`make` builds a `Replica` for an address).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from hotloop.aio import raise_if_cancelled

from .types import Replica

log = logging.getLogger(__name__)

DNS = "dns:///"
Resolve = Callable[[str, int], Awaitable[list[str]]]
"""(host, port) -> "ip:port" addresses, in the order the resolver gave them."""
_NO_SUCH_NAME = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve_all(host: str, port: int) -> list[str]:
    """Every address of `host` (A and AAAA records), as `ip:port` / `[ip6]:port`."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[str] = []
    for family, _, _, _, sockaddr in infos:
        address = f"[{sockaddr[0]}]:{port}" if family == socket.AF_INET6 else f"{sockaddr[0]}:{port}"
        if address not in out:
            out.append(address)
    return out


def parse_name(entry: str) -> tuple[str, int] | None:
    """(host, port) of a `dns:///host:port` entry; None for a plain address. ValueError for a
    `dns:///` entry without a host or a port."""
    if not entry.startswith(DNS):
        return None
    host, sep, port = entry[len(DNS):].rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{entry!r}: want dns:///<host>:<port>, e.g. dns:///rollout:50051")
    try:
        host.encode("idna")  # what the resolver does first; a bad label would fail every lookup
    except UnicodeError as e:
        raise ValueError(f"{entry!r}: {host!r} is not a host name ({e})") from None
    return host, int(port)


class Discovery:
    def __init__(self, endpoints: list[str], make: Callable[[str], Replica],
                 interval_s: float = 10.0, resolve: Resolve = resolve_all):
        """ValueError for a malformed `dns:///` entry (before anything is resolved)."""
        self._entries = [(e, parse_name(e)) for e in endpoints]
        self._make = make
        self._resolve = resolve
        self.interval_s = interval_s
        self.found: dict[str, list[str]] = {e: [] for e, name in self._entries if name}
        """The addresses each `dns:///` entry had at the last resolve."""
        self._replicas: dict[str, Replica] = {}
        self._task: asyncio.Task | None = None

    @property
    def dynamic(self) -> bool:
        """Some entry is a name to resolve again (else the set never changes)."""
        return bool(self.found)

    async def refresh(self) -> list[Replica]:
        """Resolve the names now; the replicas of every entry, each address once."""
        addresses: list[str] = []
        for entry, name in self._entries:
            if name is None:
                addresses.append(entry)
                continue
            try:
                now = await self._resolve(*name)
            except OSError as e:
                if isinstance(e, socket.gaierror) and e.errno in _NO_SUCH_NAME:
                    now = []
                else:
                    now = self.found[entry]
                    log.warning("resolving %s failed (%s); keeping %s", entry, e, now)
            if now != self.found[entry]:
                log.info("%s resolves to %s", entry, now or "no address")
            self.found[entry] = now
            addresses += now
        replicas = {}
        for a in addresses:
            if a not in replicas:
                replicas[a] = self._replicas.get(a) or self._make(a)
        self._replicas = replicas
        return list(replicas.values())

    def start(self, update: Callable[[list[Replica]], None]) -> None:
        """Resolve every `interval_s` in the background and hand each result to `update`
        (nothing to do when no entry is a name)."""
        if self.dynamic:
            self._task = asyncio.create_task(self._follow(update))

    async def _follow(self, update: Callable[[list[Replica]], None]) -> None:
        while True:
            raise_if_cancelled()  # a resolve that swallowed the close's cancel (hotloop.aio)
            await asyncio.sleep(self.interval_s)
            update(await self.refresh())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
