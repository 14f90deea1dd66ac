"""README's flow, as a new user would follow it: one peer starts a run from a config file, another joins with
the line it printed and no config, and they train together to the end; a peer whose config differs from the
swarm's experiment, or whose data does, refuses to start with one line naming what differs."""

from __future__ import annotations

import shlex
import subprocess
import sys
import uuid

import pytest

from p2ptrain import checkpoint
from p2ptrain.localswarm import LOOPBACK
from tests.integration.conftest import TINY, join_args

pytestmark = pytest.mark.integration


def printed_join_line(peer) -> list[str]:
    for line in peer.stdout_lines:
        if line.strip().startswith("p2ptrain join --initial-peers /ip4/127.0.0.1/"):
            return shlex.split(line.strip())[1:]
    raise AssertionError(f"no join line for 127.0.0.1 in its output: {peer.stdout()}")


def refused(tmp_path, *args: str) -> str:
    """Run ``p2ptrain ARGS...``, which must refuse to start: its one-line error."""
    out = subprocess.run(
        [sys.executable, "-m", "p2ptrain", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    return errors[0]


def test_a_peer_joins_with_the_printed_line_and_no_config_and_a_differing_one_is_refused(tmp_path, spawn):
    run_id = f"t{uuid.uuid4().hex[:8]}"
    # The owner waits for one more peer (its own choice): they train every round together.
    owner = spawn(*join_args(tmp_path, "owner", run_id, "--set", "swarm.min_peers=2"), name="owner")
    owner.wait_for_maddr()
    line = printed_join_line(owner)
    assert line[:2] == ["join", "--initial-peers"] and "--config" not in line

    # Other training sections, or other data under the same run: refused before it trains.
    differing = [*line, "--config", str(TINY), "--set", f"run.run_id={run_id}", "--host-maddrs", LOOPBACK]
    error = refused(
        tmp_path, *differing, "--set", "inner.lr=0.01", "--set", f"checkpoint.dir={tmp_path / 'x'}"
    )
    assert f"differs from the swarm's experiment {run_id}" in error
    assert "inner.lr: 0.01 here, 0.003 in the swarm" in error
    corpus = tmp_path / "other.txt"
    corpus.write_text("not the swarm's corpus. " * 400)
    other_data = ["--set", "data.source=text", "--set", f"data.path={corpus}"]
    error = refused(tmp_path, *differing, *other_data, "--set", f"checkpoint.dir={tmp_path / 'y'}")
    assert "data.sha256:" in error and "data.source:" in error

    # The printed line as is, plus only what is this peer's own.
    own = [
        "--host-maddrs",
        LOOPBACK,
        "--log-format",
        "json",
        "--set",
        f"checkpoint.dir={tmp_path / 'joiner'}",
    ]
    joiner = spawn(*line, *own, name="joiner")
    for name, p in (("owner", owner), ("joiner", joiner)):
        assert p.wait(240) == 0, f"{name}: {p.tail()}"
    assert any(f"Joining the swarm's experiment {run_id}" in x for x in joiner.stdout_lines), joiner.stdout()
    finals = {name: checkpoint.load(tmp_path / name / "final.safetensors") for name in ("owner", "joiner")}
    assert {f.config.training_hash() for f in finals.values()} == {finals["owner"].config.training_hash()}
    assert finals["joiner"].config.model.name == "gpt-nano", "the swarm's model, not the built-in default's"
    assert len({f.params_sha256() for f in finals.values()}) == 1, "peers disagree on the final params"
    steps = {
        name: [s["round"] for s in p.outer_steps()] for name, p in (("owner", owner), ("joiner", joiner))
    }
    assert steps["joiner"] == steps["owner"] == [0, 1, 2], steps
    sizes = [s.get("group_size") for s in owner.outer_steps()]
    assert sizes == [2, 2, 2], f"they trained every round together: {sizes}"
