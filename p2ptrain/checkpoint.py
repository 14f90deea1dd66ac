"""Model files: safetensors with the params, the outer momentum and, in the metadata, the resolved
config and the round, so that ``p2ptrain eval FILE`` needs nothing else.

A peer's own checkpoints also carry what only this peer has: its error-feedback residual, its inner
AdamW state (moments and step) and its counters, so that a restart continues its inner phase exactly
as it would have gone on. A checksum over every tensor (``state_hash``) refuses a corrupted file.

Files are written atomically (temporary file, fsync, rename): a crash leaves the previous file, never
half of a new one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from p2ptrain.config import (
    ConfigError,
    ExperimentConfig,
    deep_merge,
    format_validation_error,
    load_config,
    training_defaults,
)
from p2ptrain.diloco import DiLoCo, tensor_bytes, tensors_hash

FORMAT = "p2ptrain/1"
MOMENTUM_PREFIX = "outer_momentum."
RESIDUAL_PREFIX = "error_feedback."
INNER_PREFIX = "inner_optimizer."
_STATE_PREFIXES = (MOMENTUM_PREFIX, RESIDUAL_PREFIX, INNER_PREFIX)


class CheckpointError(ValueError):
    """A model file cannot be used. The message says which file and why."""


LOCK_FILE = ".peer.lock"
SUFFIX, TMP_SUFFIX = ".safetensors", ".tmp"
"""A model file's suffix, and the suffix of the temporary file :func:`save` writes it through."""
MAX_AUTO_DIRS = 1024


class PeerDir:
    """This peer's checkpoint directory, held while it runs: an exclusive ``flock`` on its lock file, so two
    peers started from one checkout never write into one directory.

    The kernel releases the lock when the peer exits, however it exits (kill -9 included); hivemind's
    children, forked from the peer, close their copy of the lock at once, so that a restarted peer does not
    wait for them to go.
    """

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd

    @classmethod
    def claim(cls, configured: Path | None, run_id: str) -> PeerDir:
        """``configured`` if no running peer holds it; with None, ``checkpoints/<run_id>/peer-<N>`` for the
        lowest N that no running peer holds (a restarted peer takes its directory back and resumes from it).

        Raises:
            ConfigError: ``configured`` is held by another running peer, or cannot be created.
        """
        if configured is not None:
            held = cls._try(Path(configured))
            if isinstance(held, int):
                raise ConfigError(
                    f"checkpoint.dir {configured}: another running peer (pid {held}) writes there; give each "
                    "peer a directory of its own (or leave checkpoint.dir unset: each peer then gets one)"
                )
            return held
        for n in range(MAX_AUTO_DIRS):
            held = cls._try(Path("checkpoints") / run_id / f"peer-{n}")
            if isinstance(held, PeerDir):
                return held
        raise ConfigError(
            f"checkpoint.dir: every one of checkpoints/{run_id}/peer-0..{MAX_AUTO_DIRS - 1} is in use"
        )

    @classmethod
    def _try(cls, path: Path) -> PeerDir | int:
        """The held directory, or the pid of the peer that holds it."""
        try:
            path.mkdir(parents=True, exist_ok=True)
            fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ConfigError(f"checkpoint.dir {path}: cannot use it ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                os.close(fd)
                raise ConfigError(f"checkpoint.dir {path}: cannot lock it ({e.strerror or e})") from None
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            return int(holder) if holder.isdigit() else -1
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            # What a writer killed mid-save left (save's temporary files): nobody else writes here now.
            for stale in path.glob(f"*{SUFFIX}*{TMP_SUFFIX}"):
                stale.unlink(missing_ok=True)
        except OSError as e:
            os.close(fd)
            raise ConfigError(f"checkpoint.dir {path}: cannot use it ({e.strerror or e})") from None
        _HELD.add(fd)
        return cls(path, fd)

    def release(self) -> None:
        if self._fd in _HELD:
            _HELD.discard(self._fd)
            os.close(self._fd)  # closing our only descriptor releases the lock


_HELD: set[int] = set()
"""The lock descriptors this process holds (a forked child closes its copies)."""


def _close_held_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)  # the parent's descriptor still holds the lock
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def param_names(model: torch.nn.Module) -> list[str]:
    # named_parameters() lists tied weights once, in the same order as DiLoCo's master copy.
    return [name for name, p in model.named_parameters() if p.requires_grad]


def save(
    path: Path,
    model: torch.nn.Module,
    diloco: DiLoCo,
    cfg: ExperimentConfig,
    *,
    peer_id: str = "",
    inner_optimizer: torch.optim.Optimizer | None = None,
    counters: dict[str, int] | None = None,
    swarm: dict | None = None,
) -> None:
    """Write the global params, outer momentum, EF residual and (optionally) the inner optimizer's state.

    Args:
        inner_optimizer: its per-param state is stored by param name (e.g. ``inner_optimizer.wte.weight.exp_avg``).
        counters: integers to restore on resume (inner steps done, samples done), kept in the metadata.
        swarm: what the peer has seen of the swarm (``protocol.SwarmMemory.to_dict``), kept in the metadata.
    """
    names = param_names(model)
    snap = diloco.snapshot()
    params, round_ = snap.params, snap.round
    tensors = {name: t.contiguous() for name, t in zip(names, params)}
    tensors.update({MOMENTUM_PREFIX + name: t.contiguous() for name, t in zip(names, snap.momentum)})
    tensors.update({RESIDUAL_PREFIX + name: t.contiguous() for name, t in zip(names, snap.residuals)})
    if inner_optimizer is not None:
        state = inner_optimizer.state_dict()["state"]  # keyed by the param's index, in names' order
        for index, per_param in state.items():
            for key, value in per_param.items():
                tensors[f"{INNER_PREFIX}{names[index]}.{key}"] = (
                    torch.as_tensor(value).detach().to("cpu", copy=True).contiguous()
                )
    metadata = {
        "format": FORMAT,
        "round": str(round_),
        "run_id": cfg.run.run_id,
        "peer_id": peer_id,
        "config_hash": cfg.training_hash(),
        "params_hash": tensors_hash(params),
        "state_hash": _all_tensors_hash(tensors),
        "counters": json.dumps(counters or {}),
        "swarm": json.dumps(swarm or {}),
        # Fields at their defaults left out: a release that adds fields reads it. But averaging.packed is
        # written when true (config.ABSENT_MEANS), which releases before 2026-12-03 refuse as unknown.
        "config": cfg.to_json(),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=TMP_SUFFIX)
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
            h.update(tensor_bytes(self.params[name]))
        return h.hexdigest()


def load(path: Path, data_path: Path | None = None) -> LoadedModel:
    """Read a model file written by :func:`save`. ``data_path``: where the run's data is on this machine, in
    place of the path the file's config names (another machine's); it must hold the data the run trained on.

    Raises:
        CheckpointError: missing, unreadable, not ours, or its params do not match their recorded hash; the
            data at ``data_path`` is not the run's.
    """
    loaded = _read(path, data_path)[0]
    if data_path is not None and loaded.metadata.get("config_hash") not in loaded.config.resumable_hashes():
        raise CheckpointError(
            f"{path}: the data at {data_path} is not what its run trained on (its content differs)"
        )
    return loaded


def _read(path: Path, data_path: Path | None = None) -> tuple[LoadedModel, dict[str, torch.Tensor]]:
    """:func:`load`, and every tensor of the file (its training state too): read once."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError(
            f"{path}: not a p2ptrain model file (format {str(metadata.get('format'))[:40]!r})"
        )
    config = _embedded_config(path, metadata.get("config"), data_path)
    round_ = _round_in(metadata)
    if round_ is None:
        text = str(metadata.get("round", ""))
        raise CheckpointError(f"{path}: its round is not a whole number ({text[:40]!r})")
    params = {k: v for k, v in tensors.items() if not k.startswith(_STATE_PREFIXES)}
    return LoadedModel(config=config, round=round_, params=params, metadata=metadata), tensors


def _round_in(metadata: dict[str, str]) -> int | None:
    """The round a file's metadata gives, if it is a plain whole number. A file can come from anyone: check,
    never int() blindly (int() takes '-1', ' 7' and other scripts' digits; '²' passes isdigit() and fails)."""
    text = metadata.get("round", "")
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 12 else None


MAX_CONFIG_BYTES = 1 << 20


def _embedded_config(path: Path, text: str | None, data_path: Path | None = None) -> ExperimentConfig:
    if not text:
        raise CheckpointError(f"{path}: it carries no experiment config")
    if len(text) > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path}: its embedded config is {len(text)} bytes, more than a config can be")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise CheckpointError(f"{path}: its embedded config is not valid JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: its embedded config is not a mapping of sections")
    if data_path is not None and isinstance(data.get("data", {}), dict):  # any other: refused just below
        data = {**data, "data": {**data.get("data", {}), "path": str(data_path)}}
    # Every field left out is the default (config.TRAINING_SECTIONS), never the reader's environment
    # (P2PTRAIN_* variables would fill the gaps of a settings model): the defaults go in first.
    try:
        return ExperimentConfig.model_validate(
            deep_merge(training_defaults(ExperimentConfig.model_fields), data)
        )
    except ValidationError as e:
        problems = format_validation_error(e).replace("\n", "; ")
        newer = any(item["type"] == "extra_forbidden" for item in e.errors())
        hint = " (a newer release's fields: upgrade p2ptrain to read this file)" if newer else ""
        if not newer and data_path is None and "data.path" in problems:
            hint = " (the run's data is not there on this machine: give your copy of it with --data-path)"
        raise CheckpointError(f"{path}: its embedded config is invalid: {problems}{hint}") from None
    except (ConfigError, ValueError, RecursionError) as e:
        raise CheckpointError(
            f"{path}: its embedded config is invalid: {str(e).splitlines()[0][:200]}"
        ) from None


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


@dataclass
class TrainingState:
    """Everything a peer needs to continue training from one of its checkpoints."""

    round: int
    outer: list[torch.Tensor]
    """Global params, then outer momentum: what :meth:`DiLoCo.load_state_tensors` takes."""
    residuals: list[torch.Tensor] = field(default_factory=list)
    """Error-feedback residuals, one per param (empty when the run has no error feedback)."""
    inner: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Inner optimizer state by param index, as ``Optimizer.state_dict()["state"]`` holds it."""
    counters: dict[str, int] = field(default_factory=dict)

    def load_inner_into(self, optimizer: torch.optim.Optimizer) -> None:
        if self.inner:
            optimizer.load_state_dict(
                {"state": self.inner, "param_groups": optimizer.state_dict()["param_groups"]}
            )


def load_state(model: torch.nn.Module, path: Path, config_hash: str | Collection[str]) -> TrainingState:
    """Read a checkpoint's full training state for ``model``, if its training hash is ``config_hash`` (or
    one of them: ``ExperimentConfig.resumable_hashes``).

    Raises:
        CheckpointError: unreadable, of another experiment config, or failing its recorded checksums.
    """
    loaded, tensors = _read(path)  # once: a checkpoint holds about five times the params
    if loaded.metadata.get("config_hash") not in _hashes(config_hash):
        raise CheckpointError(
            f"{path}: written by a different experiment config (run, model, data, inner or outer)"
        )
    names = param_names(model)
    missing = [k for n in names for k in (n, MOMENTUM_PREFIX + n) if k not in tensors]
    if missing:
        raise CheckpointError(
            f"{path}: {len(missing)} params or outer momentum tensors missing for this model"
        )
    params = [tensors[n] for n in names]
    momentum = [tensors[MOMENTUM_PREFIX + n] for n in names]
    if tensors_hash(params) != loaded.metadata.get("params_hash"):
        raise CheckpointError(f"{path}: params do not match their recorded hash (corrupted file?)")
    if _all_tensors_hash(tensors) != loaded.metadata.get("state_hash"):
        raise CheckpointError(f"{path}: its tensors do not match their recorded checksum (corrupted file?)")
    residuals = [tensors[RESIDUAL_PREFIX + n] for n in names if RESIDUAL_PREFIX + n in tensors]
    inner: dict[int, dict[str, torch.Tensor]] = {}
    for index, name in enumerate(names):
        prefix = f"{INNER_PREFIX}{name}."
        per_param = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if per_param:
            inner[index] = per_param
    try:
        counters = {k: int(v) for k, v in json.loads(loaded.metadata.get("counters", "{}")).items()}
    except (ValueError, TypeError, AttributeError, OverflowError):  # OverflowError: int(Infinity)
        raise CheckpointError(f"{path}: unreadable counters in its metadata") from None
    return TrainingState(
        round=loaded.round,
        outer=params + momentum,
        residuals=residuals if len(residuals) == len(names) else [],
        inner=inner if len(inner) == len(names) else {},
        counters=counters,
    )


def _all_tensors_hash(tensors: dict[str, torch.Tensor]) -> str:
    return tensors_hash([tensors[k] for k in sorted(tensors)])


def resume_latest(
    directory: Path,
    model: torch.nn.Module,
    diloco: DiLoCo,
    inner_optimizer: torch.optim.Optimizer,
    config_hash: str | Collection[str],
    on_refused: Callable[[Path, str], None] = lambda path, reason: None,
) -> tuple[Path, TrainingState] | None:
    """Load the newest valid checkpoint of this experiment in ``directory`` into DiLoCo and the inner
    optimizer: params, outer momentum, round, error-feedback residual, inner AdamW state.

    A file that is corrupted, truncated or of another config is refused (``on_refused`` says which and why)
    and the next newest is tried: a bad file is never loaded silently, and a good older one is not ignored.

    Returns:
        The file and its state (its ``counters`` are the caller's to restore), or None if none was usable.
    """
    for path in candidates(directory):
        try:
            state = load_state(model, path, config_hash)
            diloco.load_state_tensors(state.outer, round=state.round)
            state.load_inner_into(inner_optimizer)
        except (CheckpointError, ValueError) as e:
            on_refused(path, str(e))
            continue
        if state.residuals and diloco.error_feedback is not None:
            diloco.error_feedback.residuals = [r.clone() for r in state.residuals]
        return path, state
    return None


NOT_RESUMABLE = ("diverged.safetensors",)
"""Files a peer never continues from: a final state the swarm did not keep."""


def candidates(directory: Path, *, resumable_only: bool = True) -> list[Path]:
    """Checkpoint files in ``directory``, newest first: by the round each file says it holds, then by
    modification time. Not by time alone: a copy, a restore from a backup or a clock set back makes an
    older round look newest. Files whose round cannot be read come last (a resume refuses them, saying why).
    """
    files = [f for f in Path(directory).glob("*.safetensors") if f.is_file()]
    if resumable_only:
        files = [f for f in files if f.name not in NOT_RESUMABLE]
    return sorted(files, key=lambda f: (_saved_round(f), f.stat().st_mtime), reverse=True)


def _saved_round(path: Path) -> int:
    """The round in a model file's metadata (its header only is read), or -1 if it cannot be read."""
    try:
        with safe_open(str(path), framework="pt") as f:
            round_ = _round_in(f.metadata() or {})
    except (SafetensorError, OSError):
        return -1
    return -1 if round_ is None else round_


def _hashes(config_hash: str | Collection[str]) -> frozenset[str]:
    return frozenset({config_hash} if isinstance(config_hash, str) else config_hash)


def read_swarm_memory(path: Path, config_hash: str | Collection[str]) -> dict:
    """What the peer that wrote ``path`` had seen of the swarm ({} if the file does not say, is unreadable, or
    belongs to another experiment: what a peer saw of another run says nothing about this one)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            saved = json.loads(metadata.get("swarm", "{}"))
    except (SafetensorError, OSError, ValueError):
        return {}
    if metadata.get("config_hash") not in _hashes(config_hash):
        return {}
    return saved if isinstance(saved, dict) else {}


def prune(directory: Path, keep_last: int) -> None:
    """Delete periodic checkpoints (round-*.safetensors) beyond the newest ``keep_last``."""
    # By round, not by name: round-1000000 sorts before round-999999 as text.
    periodic = sorted(
        (f for f in Path(directory).glob("round-*.safetensors") if f.stem[len("round-") :].isdigit()),
        key=lambda f: int(f.stem[len("round-") :]),
    )
    for old in periodic[: max(0, len(periodic) - keep_last)]:
        old.unlink(missing_ok=True)


__all__ = [
    "CheckpointError",
    "LoadedModel",
    "TrainingState",
    "candidates",
    "load",
    "load_config",
    "load_into",
    "load_state",
    "prune",
    "read_swarm_memory",
    "resume_latest",
    "save",
]
