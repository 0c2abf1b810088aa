"""Scraping a service's `/metrics` over HTTP in tests, parsed by prometheus_client's parser."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass
class Scrape:
    families: dict  # family name -> prometheus_client Metric

    def value(self, sample: str, **labels: str) -> float:
        """The value of `sample` (a full sample name, e.g. `..._total` or `..._count`) whose
        labels include `labels`; 0.0 when there is none, so a counter's delta from before a
        sample existed is its value."""
        found = [s.value for fam in self.families.values() for s in fam.samples
                 if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(found) <= 1, f"{sample}{labels} matches {len(found)} samples"
        return found[0] if found else 0.0

    def labels(self, sample: str, key: str) -> set[str]:
        return {s.labels[key] for fam in self.families.values() for s in fam.samples
                if s.name == sample and key in s.labels}

    def type_of(self, family: str) -> str:
        assert family in self.families, f"no metric family {family!r}; have {sorted(self.families)}"
        return self.families[family].type


def parse(text: str) -> Scrape:
    return Scrape({f.name: f for f in text_string_to_metric_families(text)})


async def scrape(port: int, host: str = "127.0.0.1", path: str = "/metrics",
                 token: str = "") -> Scrape:
    """`token`: sent as `Authorization: Bearer <token>` (the gateway's users' port serves
    /metrics to the admin token only)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    async with httpx.AsyncClient() as http:
        r = await http.get(f"http://{host}:{port}{path}", timeout=10, headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain"), r.headers["content-type"]
    return parse(r.text)
