"""The part of PromQL that deploy/'s Grafana dashboard uses, evaluated over two scrapes of real endpoints.

Enough to check, without a Prometheus server, what each panel would show: selectors with label matchers,
``rate``/``increase`` over a range (the two scrapes are its ends), ``sum``/``min``/``max`` with ``by``,
and ``histogram_quantile``. Anything else is a ``PromQLError``: a new kind of query must be added here
on purpose, not silently misread.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

Labels = tuple[tuple[str, str], ...]


class PromQLError(ValueError):
    pass


@dataclass
class Scrapes:
    """Two scrapes of every target: ``before[series] -> value`` and ``after``, ``seconds`` apart."""

    before: dict[tuple[str, Labels], float]
    after: dict[tuple[str, Labels], float]
    seconds: float


@dataclass
class Result:
    series: dict[Labels, float]
    """The instant vector (label set -> value)."""
    matched: list[tuple[str, Labels]]
    """Every raw series the query's selectors matched (to check where values come from)."""


_TOKEN = re.compile(
    r"\s*(\$__rate_interval|\d+(?:ms|[smhdwy])\b|[A-Za-z_][A-Za-z0-9_:]*|\d+(?:\.\d+)?|\"[^\"]*\"|!=|=~|[{}()\[\],=+])"
)


def evaluate(query: str, scrapes: Scrapes) -> Result:
    tokens = _tokenize(query)
    parser = _Parser(tokens, scrapes)
    series = parser.expr()
    if parser.i != len(tokens):
        raise PromQLError(f"unexpected {tokens[parser.i]!r} in {query!r}")
    return Result(series, parser.matched)


def _tokenize(query: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(query):
        if query[pos:].strip() == "":
            break
        m = _TOKEN.match(query, pos)
        if not m:
            raise PromQLError(f"cannot read {query[pos:]!r}")
        tokens.append(m.group(1))
        pos = m.end()
    return tokens


class _Parser:
    AGGREGATIONS = {"sum": sum, "min": min, "max": max}

    def __init__(self, tokens: list[str], scrapes: Scrapes):
        self.tokens, self.scrapes, self.i = tokens, scrapes, 0
        self.matched: list[tuple[str, Labels]] = []

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise PromQLError(f"expected {expected!r}, got {token!r}")
        self.i += 1
        return token

    def expr(self) -> dict[Labels, float]:
        token = self.peek()
        if token in self.AGGREGATIONS:
            return self.aggregation()
        if token in ("rate", "increase"):
            return self.range_function()
        if token == "histogram_quantile":
            return self.histogram_quantile()
        return self.selector(self.scrapes.after)

    def aggregation(self) -> dict[Labels, float]:
        op = self.AGGREGATIONS[self.take()]
        by = self.by_clause() if self.peek() == "by" else None
        self.take("(")
        inner = self.expr()
        self.take(")")
        if by is None and self.peek() == "by":
            by = self.by_clause()
        groups: dict[Labels, list[float]] = {}
        for labels, value in inner.items():
            key = tuple((k, v) for k, v in labels if by is not None and k in by)
            groups.setdefault(key, []).append(value)
        return {key: op(values) for key, values in groups.items()}

    def by_clause(self) -> set[str]:
        self.take("by")
        self.take("(")
        names = {self.take()}
        while self.peek() == ",":
            self.take(",")
            names.add(self.take())
        self.take(")")
        return names

    def range_function(self) -> dict[Labels, float]:
        name = self.take()
        self.take("(")
        selector = self.parse_selector()
        self.take("[")
        self.take()  # the range: the two scrapes are its ends
        self.take("]")
        self.take(")")
        after = self.select(selector, self.scrapes.after)
        before = self.select(selector, self.scrapes.before, record=False)
        out = {}
        for labels, value in after.items():
            if labels in before:
                delta = value - before[labels]
                out[labels] = delta / self.scrapes.seconds if name == "rate" else delta
        return out

    def histogram_quantile(self) -> dict[Labels, float]:
        self.take("histogram_quantile")
        self.take("(")
        q = float(self.take())
        self.take(",")
        buckets = self.expr()
        self.take(")")
        groups: dict[Labels, list[tuple[float, float]]] = {}
        for labels, value in buckets.items():
            le = dict(labels).get("le")
            if le is None:
                raise PromQLError("histogram_quantile needs the 'le' label")
            key = tuple((k, v) for k, v in labels if k != "le")
            groups.setdefault(key, []).append((float(le), value))
        return {key: _quantile(q, sorted(points)) for key, points in groups.items()}

    def selector(self, source: dict[tuple[str, Labels], float]) -> dict[Labels, float]:
        return self.select(self.parse_selector(), source)

    def parse_selector(self) -> tuple[str, list[tuple[str, str, str]]]:
        name = self.take()
        if not re.match(r"^[A-Za-z_:][A-Za-z0-9_:]*$", name):
            raise PromQLError(f"not a metric name: {name!r}")
        matchers: list[tuple[str, str, str]] = []
        if self.peek() == "{":
            self.take("{")
            while self.peek() != "}":
                label, op, value = self.take(), self.take(), self.take()
                if op not in ("=", "!=") or not value.startswith('"'):
                    raise PromQLError(f"unsupported matcher {label}{op}{value}")
                matchers.append((label, op, value.strip('"')))
                if self.peek() == ",":
                    self.take(",")
            self.take("}")
        return name, matchers

    def select(
        self, selector: tuple[str, list[tuple[str, str, str]]], source: dict, record: bool = True
    ) -> dict[Labels, float]:
        name, matchers = selector
        out = {}
        for (series_name, labels), value in source.items():
            found = dict(labels)
            if series_name == name and all(
                (found.get(label) == value) == (op == "=") for label, op, value in matchers
            ):
                out[labels] = value
                if record:
                    self.matched.append((series_name, labels))
        return out


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile over cumulative (upper bound, count) pairs."""
    if not buckets or buckets[-1][0] != math.inf or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in buckets:
        if count >= rank:
            if upper_bound == math.inf:
                return lower_bound
            return lower_bound + (upper_bound - lower_bound) * (rank - lower_count) / max(
                count - lower_count, 1e-12
            )
        lower_bound, lower_count = upper_bound, count
    return math.nan
