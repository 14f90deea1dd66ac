"""State transfer: what a peer serves to a newcomer, and the checks a downloaded state must pass.

A state is the global params and outer momentum of one round (``DiLoCo.snapshot``), with metadata: run
id, config hash, round, and a checksum of every tensor (``state_hash``; ``params_hash`` is the same hash,
named as progress records name it). The download itself is the averager's (hivemind streams it);
the checks are here, because hivemind hands over a state truncated by a donor that died mid-way without
any error (seen in tests/integration/test_averaging.py): only the checksum catches it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from p2ptrain.diloco import Snapshot, tensors_hash

REQUIRED_KEYS = frozenset({"run_id", "config_hash", "round", "params_hash", "state_hash"})


def donation(
    snapshot: Snapshot, *, run_id: str, config_hash: str
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Metadata and tensors (params, then momentum) that a donor serves for ``snapshot``."""
    tensors = snapshot.params + snapshot.momentum
    state_hash = tensors_hash(tensors)
    metadata = dict(
        run_id=run_id,
        config_hash=config_hash,
        round=snapshot.round,
        params_hash=state_hash,  # as records report it (DiLoCo.params_hash): of params and momentum
        state_hash=state_hash,
    )
    return metadata, tensors


def check_state(
    metadata: Any,
    tensors: Sequence[torch.Tensor],
    *,
    run_id: str,
    config_hash: str,
    min_round: int = 0,
    round: int | None = None,
) -> str | None:
    """Why a downloaded state must be refused, or None if it may be loaded.

    Args:
        min_round: refuse states of earlier rounds (a catch-up wants the swarm's newest).
        round: refuse states of any other round (a rebase wants exactly ours).
    """
    if not isinstance(metadata, dict) or not metadata.keys() >= REQUIRED_KEYS:
        return "malformed metadata"
    if metadata["run_id"] != run_id:
        return f"run_id {str(metadata['run_id'])[:80]!r}"
    if metadata["config_hash"] != config_hash:
        return "the donor trains a different experiment config (run, model, data, inner or outer differ)"
    state_round = metadata["round"]
    if not isinstance(state_round, int) or isinstance(state_round, bool):
        return "malformed metadata: round"
    if round is not None and state_round != round:
        return f"round {state_round}, expected {round}"
    if state_round < min_round:
        return f"round {state_round}, expected at least {min_round}"
    if (
        not all(isinstance(t, torch.Tensor) for t in tensors)
        or tensors_hash(tensors) != metadata["state_hash"]
    ):
        return "checksum mismatch"
    return None


class StateSource(Protocol):
    def download_state(self, donors: Sequence[str], timeout: float) -> tuple[str, Any, list] | None: ...


def fetch_state(
    source: StateSource,
    donor: str,
    *,
    timeout: float,
    run_id: str,
    config_hash: str,
    round: int | None = None,
    min_round: int = 0,
) -> tuple[dict[str, Any], list[torch.Tensor]] | str:
    """Download ``donor``'s state and check it (:func:`check_state`): (metadata, tensors), or why not."""
    got = source.download_state([donor], timeout=timeout)
    if got is None:
        return "no state served"
    _, metadata, tensors = got
    problem = check_state(
        metadata, tensors, run_id=run_id, config_hash=config_hash, round=round, min_round=min_round
    )
    return problem if problem is not None else (metadata, tensors)
