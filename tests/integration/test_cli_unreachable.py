"""The command line against a real (absent) swarm: a clear one-line error, never a hang."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_unreachable_initial_peer_is_a_clear_error_not_a_hang(tmp_path):
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGPqLr56TyMWzcrRrD7qKoFtiSXvqtQdMqXhirUxDGfgh"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2ptrain",
            "join",
            "--initial-peers",
            nobody,
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--set",
            "swarm.bootstrap_timeout_s=10",
            "--set",
            f"checkpoint.dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors and "could not join the swarm through" in errors[0] and nobody in errors[0]
    assert "the swarm may have ended" in errors[0]
    # Both causes a user can act on (a node of a closed swarm answers a keyless peer as nobody would), and
    # none of hivemind's advice to its own callers.
    assert "--key-file" in errors[0] and "ensure_bootstrap_success" not in errors[0]
