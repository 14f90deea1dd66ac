"""Writing benchmark tables into docs/benchmarks.md, between <!-- name:start --> and <!-- name:end --> markers."""

from __future__ import annotations

from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def replace_block(name: str, rows: list[str], doc: Path = DOC) -> None:
    start_marker, end_marker = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = doc.read_text()
    start, end = text.find(start_marker), text.find(end_marker)
    if start == -1 or end == -1:
        raise SystemExit(f"{doc}: missing the {start_marker} / {end_marker} markers")
    block = start_marker + "\n" + "\n".join(rows) + "\n" + end_marker
    doc.write_text(text[:start] + block + text[end + len(end_marker) :])


RESULTS = Path(__file__).resolve().parent / "results"


def merge_results(file: str, part: str, value: dict) -> None:
    """Write ``value`` as the ``part`` of bench/results/``file``, keeping the file's other parts (a file that
    several benchmarks write, each its own part)."""
    import json

    path = RESULTS / file
    RESULTS.mkdir(parents=True, exist_ok=True)
    try:
        whole = json.loads(path.read_text())
    except (OSError, ValueError):
        whole = {}
    whole[part] = value
    path.write_text(json.dumps(whole, indent=2) + "\n")
