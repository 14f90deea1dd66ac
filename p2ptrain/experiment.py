"""The swarm's published experiment: what a run trains, so that a volunteer joins with one command.

The peer that starts a run signs the run's training sections (``ExperimentConfig.training_sections``:
run, model, data by content, inner, outer, averaging, verification) with its identity key and stores
them in the DHT under :data:`EXPERIMENTS_KEY`. Every peer of the run stores the same signed document
under a subkey of its own (signed by it, as every protected DHT record), so the experiment lives as
long as any peer of the run does, and a reader counts how many peers carry each one.

- ``p2ptrain join --initial-peers ADDR`` without a config file takes the run's training sections from
  the swarm (:func:`config_for`) and only its own sections (swarm, device, checkpoint, log, metrics)
  from its flags and environment.
- A peer started with a config checks it against the swarm's (:func:`check`) and refuses to start if
  a training field differs, naming the fields: two peers of one run_id never train different things.
  Timeouts and group sizes (``config.OWN_FIELDS``) are published as the run's defaults, and each peer
  may set its own.

Only data travels, never code: the model is a name from the zoo. Which experiment a run_id means, if
several claim it, is the one most peers carry (:func:`choose`); a joiner can always pass its own config.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

# hivemind's SchemaValidator speaks pydantic v1; the DHT record models use its compatibility module.
from pydantic.v1 import BaseModel, conbytes, confloat, constr

from p2ptrain.config import (
    ABSENT_MEANS,
    TRAINING_SECTIONS,
    ConfigError,
    ExperimentConfig,
    deep_merge,
    env_value,
    leave_out_absent,
    load_config,
    training_defaults,
    without_own_fields,
)
from p2ptrain.membership import peer_id_of, peer_id_of_owner

EXPERIMENTS_KEY = "p2ptrain_experiments"
"""The DHT key of every published experiment; subkey: the run id and the publisher's public key."""
MAX_SECTIONS_BYTES = 16384
"""The most a published experiment's sections may take, as JSON (the default experiment's take ~2 KB)."""
_PURPOSE = "p2ptrain experiment v1"


class ExperimentError(ValueError):
    """The swarm's experiment cannot be joined as asked (none, several runs, a config that differs)."""


class ExperimentRecord(BaseModel):
    """A run's training sections, signed by the run's owner. Stored in the DHT; written by a stranger."""

    run_id: constr(strict=True, regex=r"^[A-Za-z0-9_-]{1,64}$")  # type: ignore[valid-type]
    sections: constr(strict=True, max_length=MAX_SECTIONS_BYTES)  # type: ignore[valid-type]
    """The training sections as canonical JSON (:func:`canonical`)."""
    owner_key: conbytes(strict=True, max_length=1024)  # type: ignore[valid-type]
    """The owner's RSA public key (OpenSSH form): who started the run."""
    created: confloat(strict=True, ge=0.0, le=1e11)  # type: ignore[valid-type]
    """When the owner published it (seconds since the epoch)."""
    signature: conbytes(strict=True, max_length=1024)  # type: ignore[valid-type]
    """The owner's signature of (run_id, sections, created)."""


@dataclass(frozen=True)
class Experiment:
    """A published experiment whose owner's signature holds."""

    run_id: str
    sections: dict[str, Any]
    owner: str
    """The owner's peer id."""
    digest: str
    """A short hash of the sections: the experiment's identity."""
    created: float
    record: ExperimentRecord
    publishers: frozenset[str] = frozenset()
    """The peers that carry it in the DHT."""


def canonical(sections: Mapping[str, Any]) -> str:
    return json.dumps(sections, sort_keys=True, separators=(",", ":"))


def digest(sections: Mapping[str, Any]) -> str:
    """The experiment's identity: the same for the sections of one run whichever release wrote them."""
    return hashlib.sha256(canonical(leave_out_absent(sections)).encode()).hexdigest()[:16]


def _signed_bytes(run_id: str, sections: str, created: float) -> bytes:
    return json.dumps([_PURPOSE, run_id, sections, created]).encode()


def sign(cfg: ExperimentConfig, signer: RSAPrivateKey, *, now: float | None = None) -> ExperimentRecord:
    """This config's training sections, signed by ``signer``: we start the run and own it."""
    sections = canonical(cfg.training_sections())
    if len(sections) > MAX_SECTIONS_BYTES:
        raise ConfigError(
            f"the training sections take {len(sections)} bytes as JSON, over {MAX_SECTIONS_BYTES}"
        )
    created = round(time.time() if now is None else now, 3)
    return ExperimentRecord(
        run_id=cfg.run.run_id,
        sections=sections,
        owner_key=signer.get_public_key().to_bytes(),
        created=created,
        signature=signer.sign(_signed_bytes(cfg.run.run_id, sections, created)),
    )


def verified(record: ExperimentRecord, publishers: frozenset[str] = frozenset()) -> Experiment | None:
    """The experiment a record carries, or None if its owner's signature does not hold or it is malformed."""
    try:
        key = RSAPublicKey.from_bytes(record.owner_key)
        if not key.verify(_signed_bytes(record.run_id, record.sections, record.created), record.signature):
            return None
        sections = json.loads(record.sections)
    except Exception:  # a stranger's bytes: not a key, not JSON
        return None
    if not isinstance(sections, dict) or sorted(sections) != sorted(TRAINING_SECTIONS):
        return None
    if not all(isinstance(v, dict) for v in sections.values()):
        return None
    # Sections of fields, each a value or a list of values: anything nested deeper is not a config (and ~1000
    # levels of it would overflow the recursion of whoever compares it, at join).
    fields = [f for v in sections.values() for f in v.values()]
    if any(isinstance(x, dict | list) for f in fields for x in (f if isinstance(f, list) else [f])):
        return None
    if sections["run"].get("run_id") != record.run_id:
        return None
    return Experiment(
        run_id=record.run_id,
        sections=sections,
        owner=peer_id_of(key),
        digest=digest(sections),
        created=record.created,
        record=record,
        publishers=publishers,
    )


def published(found: Any) -> list[Experiment]:
    """Every experiment in the DHT value of :data:`EXPERIMENTS_KEY` (a dict of subkey -> value) whose
    owner's signature holds, one per (run, owner, sections), with the peers that carry it."""
    if found is None or not isinstance(getattr(found, "value", None), dict):
        return []
    carried: dict[tuple[str, bytes, str, float, bytes], tuple[ExperimentRecord, set[str]]] = {}
    for subkey, item in found.value.items():
        publisher = _publisher(subkey)
        try:
            record = ExperimentRecord.parse_obj(item.value)
        except Exception:  # the schema validator refuses these on store; skip any leftovers
            continue
        if publisher is None or not subkey.startswith(record.run_id.encode() + b"["):
            continue  # a record filed under another run's subkey
        key = (record.run_id, record.owner_key, record.sections, record.created, record.signature)
        carried.setdefault(key, (record, set()))[1].add(publisher)
    out = []
    for record, publishers in carried.values():
        experiment = verified(record, frozenset(publishers))
        if experiment is not None:
            out.append(experiment)
    return out


def _publisher(subkey: object) -> str | None:
    if not isinstance(subkey, bytes) or b"[owner:" not in subkey:
        return None
    return peer_id_of_owner(subkey[subkey.index(b"[owner:") :])


def subkey(run_id: str, public_key_marker: bytes) -> bytes:
    """The subkey a peer stores a run's experiment under: the run id, then its ``[owner:...]`` marker."""
    return run_id.encode() + public_key_marker


def choose(experiments: list[Experiment], run_id: str | None = None) -> Experiment | None:
    """The experiment of ``run_id`` (None: the swarm's only run) that most peers carry; the earliest
    published on a tie. None if the swarm publishes none for it.

    Raises:
        ExperimentError: ``run_id`` is None and the swarm trains several runs.
    """
    if run_id is None:
        runs = sorted({e.run_id for e in experiments})
        if len(runs) > 1:
            raise ExperimentError(
                f"this swarm trains several runs ({', '.join(runs)}): pick one with --run-id"
            )
    candidates = [e for e in experiments if run_id is None or e.run_id == run_id]
    if not candidates:
        return None
    return min(candidates, key=lambda e: (-len(e.publishers), e.created, e.digest))


def differences(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """``section.field: OURS here, THEIRS in the swarm`` for every field that differs. A field that one side
    leaves out is at its default there (``config.training_defaults``: a newer release leaves out the fields
    at their defaults, an older one wrote them all); one this release does not know is named as such."""
    defaults = _flat(training_defaults())
    mine, swarm = _flat(ours), _flat(theirs)
    out = []
    for key in sorted(mine.keys() | swarm.keys()):
        if key not in defaults and key not in mine:  # a newer release's field, set in the swarm
            out.append(
                f"{key}: not known to this p2ptrain, {_show(swarm[key])} in the swarm (a newer release's field: "
                "upgrade p2ptrain)"
            )
            continue
        here, there = mine.get(key, defaults.get(key)), swarm.get(key, defaults.get(key))
        if here != there:
            out.append(f"{key}: {_show(here)} here, {_show(there)} in the swarm")
    return out


def peers_count(n: int) -> str:
    return f"{n} peer" if n == 1 else f"{n} peers"


def _flat(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: Any) -> str:
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a sha256: enough to tell two apart
    return json.dumps(value)


def check(cfg: ExperimentConfig, experiment: Experiment) -> None:
    """Refuse a config whose training sections differ from the swarm's experiment.

    Raises:
        ConfigError: one line naming every field that differs, and the experiment.
    """
    diff = differences(cfg.agreed_sections(), without_own_fields(experiment.sections))
    if not diff:
        return
    data_hint = ""
    if any(d.startswith("data.sha256:") for d in diff):
        data_hint = (
            " (data.sha256 is the corpus's content: this peer's Python ships other documentation text than "
            "the run's; join with the Python release the swarm runs (python --version), or train on a file "
            "every peer has, data.source: text)"
            if cfg.data.source == "pydoc"
            else " (data.sha256 is the corpus's content: this peer's data.path holds other data)"
        )
    carried = peers_count(len(experiment.publishers))
    raise ConfigError(
        f"this config differs from the swarm's experiment {experiment.run_id} (published by "
        f"{experiment.owner[-8:]}, carried by {carried}): {'; '.join(diff)}{data_hint}. "
        "Join without --config to train the swarm's experiment, or give this run another run.run_id"
    )


def config_for(
    experiment: Experiment, overrides: dict[str, Any] | None = None, own: dict[str, Any] | None = None
) -> ExperimentConfig:
    """A joiner's config: the swarm's training sections, and the joiner's own sections from ``overrides``
    (flags, ``--set``), the environment and ``own`` (a volunteer's config file, which sets only its own
    fields), in that order of precedence. A training field the joiner sets is checked like a config file's.

    Raises:
        ConfigError: the published sections do not make a config here, the joiner lacks the corpus, or a
            field it set differs from the swarm's.
    """
    base = json.loads(canonical(experiment.sections))  # a deep copy
    defaults = training_defaults()
    unknown = sorted(
        f"{name}.{key}"
        for name, fields in base.items()
        for key in fields
        if key not in defaults.get(name, {}) and (name, key) != ("data", "sha256")
    )
    if unknown:
        raise ConfigError(
            f"the swarm's experiment {experiment.run_id} (published by {experiment.owner[-8:]}) sets "
            f"{', '.join(unknown)}, which this p2ptrain does not know: a newer release published it; upgrade "
            "p2ptrain to join"
        )
    for name, fields in ABSENT_MEANS.items():  # left out there means other than the default here
        for key, value in fields.items():
            base.setdefault(name, {}).setdefault(key, value)
    base["data"].pop("sha256", None)
    base = deep_merge(base, own or {})  # the file's layer: below the environment and the flags
    data = base["data"]
    overrides = overrides or {}
    wanted = {
        "text": ("a text file", "FILE"),
        "prepared": ("a prepared corpus", "DIR (`p2ptrain data prepare`)"),
        "idx": ("MNIST's IDX files", "DIR"),
        "images": ("a folder of images", "DIR"),
    }
    source = data.get("source")  # a stranger's value: checked by the config below, compared as a string here
    given = (overrides.get("data") or {}).get("path") or env_value("data", "path") or data.get("path")
    if isinstance(source, str) and source in wanted and not given:
        what, flag = wanted[source]
        raise ConfigError(
            f"the swarm's experiment {experiment.run_id} trains on {what} (sha256 "
            f"{str(experiment.sections['data'].get('sha256', '?'))[:12]}): give your copy of it with "
            f"--set data.path={flag}"
        )
    try:
        cfg = load_config(None, deep_merge({}, overrides), base=base)
    except ConfigError as e:
        raise ConfigError(
            f"with the swarm's experiment {experiment.run_id} (published by {experiment.owner[-8:]}): "
            f"{str(e).replace(chr(10), '; ')}"
        ) from None
    check(cfg, experiment)
    return cfg
