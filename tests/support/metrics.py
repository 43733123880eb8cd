"""Scraping a metrics port and reading the exposition with prometheus_client's parser."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


@dataclass
class Scrape:
    """One parsed exposition: family types by name, and every sample."""

    types: dict[str, str]
    samples: list[Sample]

    @classmethod
    def parse(cls, text: str) -> Scrape:
        types, samples = {}, []
        for family in text_string_to_metric_families(text):
            types[family.name] = family.type
            samples.extend(family.samples)
        return cls(types, samples)

    def series(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        """Every sample called `name`, by its label set."""
        return {frozenset(s.labels.items()): s.value for s in self.samples if s.name == name}

    def by(self, name: str, label: str) -> dict[str, float]:
        """The samples called `name` by the value of their one label."""
        found = {s.labels[label]: s.value for s in self.samples if s.name == name}
        assert all(len(s.labels) == 1 for s in self.samples if s.name == name)
        return found

    def value(self, name: str, **labels: str) -> float:
        series = self.series(name)
        key = frozenset(labels.items())
        assert key in series, f"{name}{labels} not in metrics (has {[dict(k) for k in series]})"
        return series[key]


async def scrape_text(port: int) -> str:
    """GET /metrics on 127.0.0.1:`port`: the text format, checked to be it."""
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    return response.text


async def scrape(port: int) -> Scrape:
    return Scrape.parse(await scrape_text(port))
