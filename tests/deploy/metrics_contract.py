"""tests/deploy/metrics.txt: the metric families gpufeedd exports, with their types and labels."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Dict, FrozenSet

METRICS_TXT = pathlib.Path(__file__).resolve().with_name("metrics.txt")
TYPES = ("counter", "gauge", "histogram")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    type: str
    labels: FrozenSet[str]  # every label it may carry (the opt-in ones too)
    optional: FrozenSet[str] = frozenset()  # those only an opt-in adds (`uid?` in metrics.txt)

    def label_sets(self) -> FrozenSet[FrozenSet[str]]:
        """The label names a sample may carry: without the opt-in labels, or with them."""
        return frozenset([self.labels - self.optional, self.labels])

    def series_names(self) -> FrozenSet[str]:
        """The names its samples carry: a histogram's _bucket, _sum and _count series."""
        if self.type == "histogram":
            return frozenset(self.name + s for s in ("_bucket", "_sum", "_count"))
        return frozenset([self.name])


def load(path: pathlib.Path = METRICS_TXT) -> Dict[str, Family]:
    families: Dict[str, Family] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, kind, *labels = line.split()
        if kind not in TYPES:
            raise ValueError(f"{path}:{number}: type {kind!r} is not one of {TYPES}")
        if name in families:
            raise ValueError(f"{path}:{number}: {name} listed twice")
        if (kind == "counter") != name.endswith("_total"):
            raise ValueError(f"{path}:{number}: {name}: counters, and only they, end in _total")
        optional = frozenset(l[:-1] for l in labels if l.endswith("?"))
        families[name] = Family(name, kind, frozenset(l.rstrip("?") for l in labels), optional)
    return families


def by_series_name(families: Dict[str, Family]) -> Dict[str, Family]:
    """Maps every series name (a histogram's _bucket/_sum/_count too) to its family."""
    return {s: f for f in families.values() for s in f.series_names()}
