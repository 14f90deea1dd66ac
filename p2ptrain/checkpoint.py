"""Model files: safetensors with the params, the outer momentum and, in the metadata, the resolved
config and the round, so that ``p2ptrain eval FILE`` needs nothing else.

Files are written atomically (temporary file, fsync, rename): a crash leaves the previous file, never
half of a new one.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from p2ptrain.config import ConfigError, ExperimentConfig, load_config
from p2ptrain.diloco import DiLoCo, tensors_hash

FORMAT = "p2ptrain/1"
MOMENTUM_PREFIX = "outer_momentum."
RESIDUAL_PREFIX = "error_feedback."


class CheckpointError(ValueError):
    """A model file cannot be used. The message says which file and why."""


def param_names(model: torch.nn.Module) -> list[str]:
    # named_parameters() lists tied weights once, in the same order as DiLoCo's master copy.
    return [name for name, p in model.named_parameters() if p.requires_grad]


def save(
    path: Path, model: torch.nn.Module, diloco: DiLoCo, cfg: ExperimentConfig, *, peer_id: str = ""
) -> None:
    names = param_names(model)
    with diloco.lock:
        params = [m.clone() for m in diloco.master]
        momentum = [b.clone() for b in diloco.momentum_buffers()]
        round_ = diloco.round
        residuals = [r.clone() for r in diloco.error_feedback.residuals] if diloco.error_feedback else []
    tensors = {name: t.contiguous() for name, t in zip(names, params)}
    tensors.update({MOMENTUM_PREFIX + name: t.contiguous() for name, t in zip(names, momentum)})
    tensors.update({RESIDUAL_PREFIX + name: t.contiguous() for name, t in zip(names, residuals)})
    metadata = {
        "format": FORMAT,
        "round": str(round_),
        "run_id": cfg.run.run_id,
        "peer_id": peer_id,
        "config_hash": cfg.training_hash(),
        "params_hash": tensors_hash(params),
        "config": json.dumps(cfg.model_dump(mode="json")),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


@dataclass
class LoadedModel:
    config: ExperimentConfig
    round: int
    params: dict[str, torch.Tensor]
    metadata: dict[str, str]

    def params_sha256(self) -> str:
        """sha256 of the params' bytes in file order: equal on peers that hold identical params."""
        import hashlib

        h = hashlib.sha256()
        for name in sorted(self.params):
            h.update(self.params[name].contiguous().numpy().tobytes())
        return h.hexdigest()


def load(path: Path) -> LoadedModel:
    """Read a model file written by :func:`save`.

    Raises:
        CheckpointError: missing, unreadable, not ours, or its params do not match their recorded hash.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        tensors = load_file(str(path))
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a p2ptrain model file (format {metadata.get('format')!r})")
    try:
        config = ExperimentConfig.model_validate(json.loads(metadata["config"]))
    except (ConfigError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: its embedded config is invalid: {e}") from None
    params = {k: v for k, v in tensors.items() if not k.startswith((MOMENTUM_PREFIX, RESIDUAL_PREFIX))}
    return LoadedModel(config=config, round=int(metadata["round"]), params=params, metadata=metadata)


def load_into(model: torch.nn.Module, loaded: LoadedModel, path: Path | str = "") -> None:
    names = param_names(model)
    missing = [n for n in names if n not in loaded.params]
    if missing:
        raise CheckpointError(f"{path}: missing params {missing[:3]} for this model")
    params = [loaded.params[n] for n in names]
    if tensors_hash(params) != loaded.metadata.get("params_hash"):
        raise CheckpointError(f"{path}: params do not match their recorded hash (corrupted file?)")
    with torch.no_grad():
        for (_, p), t in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], params):
            if p.shape != t.shape:
                raise CheckpointError(f"{path}: param shape {tuple(t.shape)} does not fit {tuple(p.shape)}")
            p.copy_(t)


__all__ = ["CheckpointError", "LoadedModel", "load", "load_config", "load_into", "save"]
