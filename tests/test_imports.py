"""p2ptrain's modules import each other without cycles, counting every import a module makes (local ones too)."""

import ast

from tests.conftest import ROOT

PACKAGE = ROOT / "p2ptrain"


def imports_of(path) -> set[str]:
    """The p2ptrain modules that a module imports, at any level of its code."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("p2ptrain.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "p2ptrain":
            if node.module == "p2ptrain":  # from p2ptrain import telemetry, checkpoint
                found |= {f"p2ptrain.{a.name}" for a in node.names}
            else:
                found.add(node.module)
    return found


def graph() -> dict[str, set[str]]:
    modules = {f"p2ptrain.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return {
        name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()
    }


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles_between_p2ptrain_modules():
    edges = graph()
    assert len(edges) > 20 and "p2ptrain.config" in edges["p2ptrain.trainer"]
    assert find_cycle(edges) is None, " -> ".join(find_cycle(edges) or [])


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_round_protocol_and_records_touch_no_network_or_model():
    for name in ("protocol", "records"):
        source = (PACKAGE / f"{name}.py").read_text()
        assert "hivemind" not in imports_text(source) and "torch" not in imports_text(source), name


def imports_text(source: str) -> str:
    return " ".join(
        ast.unparse(n) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import | ast.ImportFrom)
    )
