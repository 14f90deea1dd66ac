"""A stopped peer restarted on the same checkpoint dir resumes where it was, refusing bad files."""

from __future__ import annotations

import signal
import time
import uuid

import pytest

from tests.integration.conftest import join_args

pytestmark = pytest.mark.integration


def wait_for(peer, predicate, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in peer.events() if predicate(e)]
        if found:
            return found
        assert peer.proc.poll() is None, peer.log_path.read_text()[-2000:]
        time.sleep(0.2)
    raise AssertionError(peer.log_path.read_text()[-2000:])


def test_restart_resumes_from_its_own_checkpoint_and_refuses_a_corrupted_one(tmp_path, spawn):
    args = join_args(tmp_path, "p", f"t{uuid.uuid4().hex[:8]}", "--set", "outer.num_rounds=1000")
    first = spawn(*args, name="first")
    wait_for(first, lambda e: e.get("event") == "outer step" and e["round"] >= 2)
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0
    saved = tmp_path / "p" / "interrupted.safetensors"
    assert saved.is_file()
    stopped_at = max(e["round"] for e in first.events() if e.get("event") == "outer step") + 1

    corrupted = tmp_path / "p" / "newer-but-broken.safetensors"
    corrupted.write_bytes(saved.read_bytes()[:200])  # truncated, and newer than the good file

    second = spawn(*args, name="second")
    resumed = wait_for(second, lambda e: e.get("event") == "resumed from checkpoint")
    assert resumed[0]["round"] == stopped_at and resumed[0]["path"] == str(saved)
    # its own inner AdamW moments and step counters come back too (warmup is not redone)
    assert resumed[0]["inner_optimizer"] is True and resumed[0]["inner_steps_total"] >= 5 * stopped_at
    refused = [e for e in second.events() if e.get("event") == "refused a checkpoint"]
    assert [e["path"] for e in refused] == [str(corrupted)]
    step = wait_for(second, lambda e: e.get("event") == "outer step")
    assert step[0]["round"] == stopped_at  # it trains on from where it stopped, not from round 0
