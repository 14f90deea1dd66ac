"""The experiment config: one typed model, documented once.

Every field's docstring is its help text: ``p2ptrain config reference`` renders them to
``docs/config.md``. Sources, highest precedence first:

1. command-line flags and ``--set section.key=value``,
2. environment variables ``P2PTRAIN_<SECTION>__<KEY>`` (e.g. ``P2PTRAIN_INNER__LR=3e-4``),
3. the YAML file,
4. the defaults below: the built-in default experiment (``configs/default.yaml`` spells it out, and a test
   keeps the two equal).

Unknown keys, wrong types and impossible combinations raise :class:`ConfigError`, whose
message names the field path; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import hashlib
import json
import os
import re
import types
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from p2ptrain.addrs import check_peer_maddr, parse_multiaddr, read_at_most
from p2ptrain.records import MAX_REPLICAS

ENV_PREFIX = "P2PTRAIN_"

_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # fullmatch: "$" would let a trailing newline in


MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 8, 1 << 20
"""The block sizes of int8 / int4 quantization (averaging.block_size): a part of another is refused."""

MAX_SECONDS = 1e7
"""The longest duration a setting may take (about 116 days): beyond it, clocks and timestamps overflow."""


class ConfigError(ValueError):
    """A user's config is wrong. The message is one line per problem, each naming the field."""


class _Section(BaseModel):
    # allow_inf_nan: a YAML .inf passes every `gt=0` bound that refuses .nan, and trains nothing.
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )


class RunConfig(_Section):
    run_id: str = "p2ptrain-default"
    """Name of the training run. Peers train together only if their run_id matches; every DHT key lives
    under it. Letters, digits, '-' and '_' only."""
    seed: int = Field(default=0, ge=-(1 << 63), lt=1 << 63)
    """Seed for model initialization and data order. Every peer of a run must use the same seed."""

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, value: str) -> str:
        if not _RUN_ID.fullmatch(value):
            raise ValueError("must be 1-64 characters of letters, digits, '-' and '_'")
        return value


class ModelConfig(_Section):
    name: Literal[
        "gpt-nano",
        "gpt-micro",
        "gpt-mini",
        "gpt-small",
        "llama-nano",
        "llama-micro",
        "llama-mini",
        "llama-small",
        "llama-100m",
        "llama-300m",
        "llama-1b",
        "cnn-tiny",
        "cnn-small",
        "cnn-medium",
    ] = "gpt-micro"
    """Model from the zoo (p2ptrain/models.py): GPTs (nanoGPT's shape) from 0.1M to 10M parameters,
    Llama-shaped decoders (RMSNorm, rotary embeddings, SwiGLU) from 0.1M to 1B, which `p2ptrain export` writes
    as a folder that Hugging Face transformers opens, or small CNNs (cnn-*) for image data. The vocabulary
    follows the data (256 bytes, or a BPE's), as do a CNN's classes, channels and image size."""
    context_length: int = Field(default=64, ge=8, le=8192)
    """Tokens per training sequence (language models; a CNN takes whole images)."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout probability inside the transformer blocks (a CNN's: before its classifier)."""


class DataConfig(_Section):
    source: Literal["pydoc", "text", "prepared", "digits", "idx", "images"] = "pydoc"
    """Text: 'pydoc': the documentation topics that ship with every Python (offline, ~0.47 MB, one token per
    byte). 'text': a UTF-8 text file of your own, given in data.path, read into memory (one token per byte).
    'prepared': a folder that `p2ptrain data prepare` wrote, given in data.path: token shards (bytes or a BPE)
    read from disk window by window, for corpora of any size.
    Images (for cnn-* models): 'digits': the 1,797 8x8 digits that ship with scikit-learn (offline).
    'idx': a folder with MNIST's IDX files (train-images-idx3-ubyte, ..., gzipped or not). 'images': a folder
    of images, one subfolder per class (or train/ and test/ with class subfolders). docs/data.md."""
    path: Path | None = None
    """The text file for source 'text'; the folder for sources 'prepared', 'idx' and 'images'."""
    val_fraction: float = Field(default=0.05, gt=0.0, lt=0.5)
    """Fraction of the corpus (its end), or of the training images, held out for validation."""
    eval_batches: int = Field(default=20, ge=1)
    """Validation batches (of inner.batch_size sequences or images) used to compute the validation loss."""
    eval_by: Literal["one", "all"] = "one"
    """Who computes the validation loss after an outer step. 'one': one peer of each averaging group, in turn
    by round (the group's peers hold the same params, so one evaluation is enough, and the others go on
    training); 'all': every peer, every round. Every peer evaluates the last round. The round's log line says
    who did (evaluated_by)."""
    eval_every: int = Field(default=1, ge=1)
    """Compute the validation loss after every this many rounds only (and after the last): an evaluation is
    data.eval_batches forward passes on its peer's critical path, which the round's other peers wait out at
    the next barrier. The rounds in between log no val_loss."""

    @model_validator(mode="after")
    def _check_path(self) -> DataConfig:
        try:
            return self._checked_path()
        except OSError as e:  # a name too long, a folder we may not enter: Path.is_dir() raises those
            raise ValueError(f"data.path: {self.path}: cannot read it ({e.strerror or e})") from None

    def _checked_path(self) -> DataConfig:
        if self.source == "text":
            if self.path is None:
                raise ValueError("data.path is required when data.source is 'text'")
            if self.path.is_dir():
                raise ValueError(f"data.path: {self.path} is a directory; give one UTF-8 text file")
            if not self.path.is_file():
                raise ValueError(f"data.path: no such file: {self.path}")
            from p2ptrain.prepare import not_utf8_at  # imports nothing of ours

            if (offset := not_utf8_at(self.path)) is not None:
                raise ValueError(
                    f"data.path: {self.path} is not UTF-8 text (byte {offset}); data.source 'text' reads a text "
                    "file (`p2ptrain data prepare` takes JSONL, Parquet and folders of text files)"
                )
        elif self.source == "prepared":
            from p2ptrain.prepare import Manifest  # imports nothing of ours

            if self.path is None:
                raise ValueError("data.path is required when data.source is 'prepared'")
            if not self.path.is_dir():
                raise ValueError(f"data.path: {self.path} is not a folder that `p2ptrain data prepare` wrote")
            try:
                Manifest.read(self.path)
            except ValueError as e:
                raise ValueError(f"data.path: {e}") from None
        elif self.source in ("idx", "images"):
            if self.path is None:
                raise ValueError(
                    f"data.path is required when data.source is {self.source!r}: give the folder it reads "
                    "(--set data.path=DIR)"
                )
            if not self.path.is_dir():
                raise ValueError(f"data.path: {self.path} is not a folder")
        elif self.path is not None:
            raise ValueError("data.path is only used with data.source 'text', 'prepared', 'idx' or 'images'")
        return self

    @property
    def is_images(self) -> bool:
        return self.source in ("digits", "idx", "images")


class InnerConfig(_Section):
    optimizer: Literal["adamw"] = "adamw"
    """Inner optimizer, run locally on each peer's device."""
    lr: float = Field(default=2e-3, gt=0.0)
    """Inner learning rate (peak, after warmup)."""
    weight_decay: float = Field(default=0.1, ge=0.0)
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas, each at least 0 and below 1."""

    @field_validator("betas")
    @classmethod
    def _check_betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError("each must be at least 0 and below 1")
        return value

    warmup_steps: int = Field(default=20, ge=0)
    """Linear warmup of the inner learning rate over this many local steps (counted across rounds)."""
    batch_size: int = Field(default=16, ge=1, le=1 << 20)
    """Sequences per inner step on this peer."""
    num_inner_steps: int = Field(default=15, ge=1)
    """H: inner steps per round before the peers average their pseudo-gradients (with inner.round_seconds:
    the most a peer does in a round; it also bounds the weight a peer may claim)."""
    round_seconds: float | None = Field(default=None, gt=0.0, le=MAX_SECONDS)
    """Rounds by time: each peer trains a round's inner phase for this many seconds, then stops, instead of
    doing exactly inner.num_inner_steps steps. A fast device does more steps and a slow one fewer (at least
    one, at most inner.num_inner_steps), each weighted by the samples it processed, so that nobody waits for
    the slowest. None: every peer does inner.num_inner_steps steps (rounds by steps)."""
    grad_clip: float = Field(default=1.0, ge=0.0)
    """Clip the gradient norm to this value; 0 turns clipping off."""
    max_steps_while_waiting: int = Field(default=0, ge=0)
    """Rounds by steps: a peer that has done its inner.num_inner_steps goes on training its round, up to this
    many steps more, while the round's slower peers finish theirs, instead of waiting for them at the barrier
    (0: it waits). Its pseudo-gradient then holds more progress but weighs as a full round's
    (inner.num_inner_steps x inner.batch_size samples), as every other finished peer's. A peer whose steps
    take over a quarter of averaging.matchmaking_time_s does not train on (it would join its group late).
    With outer.overlap a peer trains on only if the previous round's sync has landed by its H-th step.
    Not for verifiable rounds (verification.replicas > 1) nor with inner.round_seconds."""


class OuterConfig(_Section):
    lr: float = Field(default=0.7, gt=0.0)
    """Outer learning rate of the SGD step on the averaged pseudo-gradient (DiLoCo: 0.7). A small model with
    few inner steps a round can be on the edge of stable at 0.7, and overlap's timing noise then spoils a run
    now and then: configs/tiny.yaml (gpt-nano, 5 steps a round) uses 0.5 (docs/benchmarks.md, overlap in
    groups of two)."""
    momentum: float = Field(default=0.5, ge=0.0, lt=1.0)
    """Outer momentum. The DiLoCo paper's 0.9 suits long runs (hundreds of rounds); in the short default
    experiment 0.5 does better (docs/benchmarks.md, tuning)."""
    nesterov: bool = True
    """Use Nesterov momentum for the outer step (DiLoCo: yes)."""
    num_rounds: int = Field(default=16, ge=1)
    """Outer rounds to train. Every peer stops after this round and writes the final model."""
    overlap: bool = True
    """Average a round's pseudo-gradient while the next round trains (a one-step-delayed outer step): once
    the round's barrier is passed (every peer of it is done), its all-reduce, outer step and evaluation run
    in the background during the next round's inner phase, whose progress so far is carried over onto the
    new global params when they land (a share of it: outer.overlap_carry). The wait for the round's slower
    peers is not overlapped (steps taken then would all start from stale params): inner.max_steps_while_waiting
    or inner.round_seconds put it to use. On by default since 2026-12-04 (docs/benchmarks.md, utilization);
    a swarm of an older release, which leaves the field out, runs in turn (false). Verifiable rounds
    (verification.replicas > 1) never overlap: replicas must start a round from its params."""
    overlap_carry: float = Field(default=0.5, ge=0.0, le=1.0)
    """With outer.overlap: the share of the inner progress made while a round's sync ran that is kept when its
    new global params land (1: all of it, as releases before 2026-12-04 did; 0: none, those steps are then
    wasted). Those steps were taken from the peer's own params, not the new global ones: in the default
    experiment keeping half of them ended lower than keeping all of them in 6 of 6 seeds, and cost less than
    keeping 0.75 or 0.25 of them (docs/benchmarks.md, overlapping the outer sync). Each peer's own: it never
    changes the params the swarm agrees on."""


class AveragingConfig(_Section):
    compression: Literal["none", "fp16", "int8", "int4"] = "int8"
    """Wire format of pseudo-gradients in the all-reduce: none (fp32), fp16, or blockwise int8 / int4 with one
    float32 absmax scale per block (0.254x and 0.129x of fp32's bytes at block_size 256)."""
    block_size: int = Field(default=256, ge=MIN_BLOCK_SIZE, le=MAX_BLOCK_SIZE)
    """Values per quantization block for int8 / int4 (even, at most 1048576). Smaller blocks: less error, more
    scale bytes."""
    small_tensor_numel: int = Field(default=4096, ge=1)
    """Tensors with fewer values (biases, norms) are sent as fp16 under int8 / int4."""
    packed: bool = True
    """Send the pseudo-gradient packed into a few flat tensors (the small tensors in one, the others in one,
    each starting on a block) rather than tensor by tensor: the same values on the wire in far fewer parts, so
    a faster all-reduce. centered_clip then judges slices of the packed tensors rather than whole tensors. A
    published experiment or a checkpoint that leaves this out means false (releases before 2026-12-03 send
    tensor by tensor)."""
    agreed_groups: bool = True
    """Average under an id that commits to the whole group as the leader relayed it (its members in order and
    what each joined with), so that members told different groups by a hostile leader find out (each holds
    no group of the other's id) instead of averaging misaligned slices or judging each other's honest parts
    malformed. A published experiment or a checkpoint that leaves this out means false (releases before
    2026-12-06 average under the leader's id alone, and cannot average with a peer that does this)."""
    settled_groups: bool = True
    """Before the all-reduce, every peer says whom its barrier found ready (its record's ``group``) and
    waits, up to averaging.matchmaking_time_s, to hear the same from each of them; it then averages with
    everyone any of them named (and they named, and so on), so that a peer that turned ready just as the
    barriers passed is in every honest peer's group or in none. Without it, one peer named it and another
    did not: they named different leaders and went into different groups, and the round lost a member's
    work (docs/architecture.md, One round). A published experiment or a checkpoint that leaves this
    out means false (releases before 2026-12-06 neither publish nor wait for the group)."""
    error_feedback: bool = False
    """Keep what quantization dropped from this peer's pseudo-gradient and add it to the next round's
    (EF-SGD). Kept in checkpoints."""
    aggregator: Literal["centered_clip", "mean"] = "centered_clip"
    """How a reducer combines its groupmates' parts: centered_clip (robust: a part far beyond the others'
    spread gets no weight, and one within it moves the result by at most averaging.clip_radius times the
    spread, times its share of the weight; the exact weighted mean whenever no part is that far) or mean (the
    plain weighted mean, which one groupmate can move anywhere). Robustness needs groups of three or more."""
    clip_radius: float = Field(default=2.0, gt=0.0)
    """centered_clip's clipping radius, in units of the spread: the median distance of the parts from their
    coordinate-wise median, measured for every part. Smaller: more robust, but honest parts get clipped."""
    reject_radius: float = Field(default=4.0, gt=0.0)
    """centered_clip leaves out a part farther than this many spreads from the coordinate-wise median. At
    least averaging.clip_radius."""
    min_group_size: int = Field(default=2, ge=1)
    """Smallest group worth an all-reduce; a peer that finds fewer applies its own pseudo-gradient."""
    target_group_size: int = Field(default=64, ge=2)
    """Largest group in one all-reduce. DiLoCo wants the whole swarm in one group. Matchmaking assembles a
    group as soon as the peers the barrier saw ready are in (at most this many)."""
    matchmaking_time_s: float = Field(default=3.0, gt=0.0, le=MAX_SECONDS)
    """How long a peer gathers a group before the all-reduce starts, at most: a group the barrier expected
    starts once everyone is in; this timer runs out only when a groupmate fails to show up."""
    request_timeout_s: float = Field(default=1.5, gt=0.0, le=MAX_SECONDS)
    """Timeout of one matchmaking request. Must be smaller than averaging.matchmaking_time_s."""
    matchmaking_timeout_s: float = Field(default=15.0, gt=0.0, le=MAX_SECONDS)
    """Give up looking for a group after this long (then retry, or apply this peer's own pseudo-gradient).
    Must exceed averaging.matchmaking_time_s; generous, since a loaded machine answers slowly."""
    allreduce_timeout_s: float = Field(default=120.0, gt=0.0, le=MAX_SECONDS)
    """Give up an all-reduce (and fall back to this peer's own pseudo-gradient) after this long. Must exceed
    twice averaging.next_chunk_timeout_s, the longest a groupmate that stalls as reducer is waited for."""
    next_chunk_timeout_s: float = Field(default=30.0, gt=0.0, le=MAX_SECONDS)
    """A sender that has not started, or a groupmate silent for this long during the all-reduce, is dropped
    from it. Generous on purpose: a slow home uplink or a starved CPU must not cost a peer its round."""
    barrier_timeout_s: float = Field(default=300.0, gt=0.0, le=MAX_SECONDS)
    """After its inner phase, a peer waits at most this long for the swarm's other peers of the same round
    to finish theirs before it averages with whoever is ready."""
    retries: int = Field(default=1, ge=0)
    """Extra averaging attempts after a failed one, before the peer applies its own pseudo-gradient. More
    follow, one at a time, while a groupmate's record says it is still averaging the round (held up in an
    attempt of its own), if they can begin within 2 x averaging.matchmaking_timeout_s +
    averaging.allreduce_timeout_s of the round's sync's start."""

    @model_validator(mode="after")
    def _check_timeouts(self) -> AveragingConfig:
        if self.block_size % 2:
            raise ValueError(f"averaging.block_size must be even, got {self.block_size}")
        if self.error_feedback and self.compression == "none":
            raise ValueError(
                "averaging.error_feedback needs a lossy averaging.compression (fp16, int8 or int4)"
            )
        if self.request_timeout_s >= self.matchmaking_time_s:
            raise ValueError(
                "averaging.request_timeout_s must be smaller than averaging.matchmaking_time_s "
                f"({self.request_timeout_s} >= {self.matchmaking_time_s})"
            )
        if self.matchmaking_timeout_s <= self.matchmaking_time_s:
            raise ValueError(
                "averaging.matchmaking_timeout_s must exceed averaging.matchmaking_time_s "
                f"({self.matchmaking_timeout_s} <= {self.matchmaking_time_s})"
            )
        if self.allreduce_timeout_s <= 2 * self.next_chunk_timeout_s:
            raise ValueError(
                "averaging.allreduce_timeout_s must exceed twice averaging.next_chunk_timeout_s "
                f"({self.allreduce_timeout_s} <= 2 * {self.next_chunk_timeout_s})"
            )
        if self.reject_radius < self.clip_radius:
            raise ValueError(
                f"averaging.reject_radius ({self.reject_radius}) must be at least averaging.clip_radius "
                f"({self.clip_radius})"
            )
        if self.min_group_size > self.target_group_size:
            raise ValueError("averaging.min_group_size must not exceed averaging.target_group_size")
        return self


class VerificationConfig(_Section):
    replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS)
    """Peers per data shard in a round: 1 turns verification off (robust aggregation, averaging.aggregator,
    still guards the average); 2 or 3 make rounds verifiable: untrusted peers share their shard with
    trusted ones, replicas compare sketches of their pseudo-gradients, and a replica group that disagrees
    is left out of the average. Every peer of a run must use the same value."""
    audit_fraction: float = Field(default=0.1, ge=0.0, le=1.0)
    """Chance that a trusted peer shares its shard with another trusted peer in a round (an audit). 0:
    trusted peers are never checked again; 1: every shard is trained twice."""
    rounds_to_trust: int = Field(default=8, ge=1)
    """Verified rounds in agreement after which a peer is trusted (and stops needing a partner)."""
    strikes_to_ban: int = Field(default=2, ge=1)
    """Convictions within verification.strike_window_rounds that ban a peer for the rest of the run."""
    strike_window_rounds: int = Field(default=64, ge=1)
    """How many rounds a conviction counts towards a ban."""
    tolerance: float = Field(default=0.02, gt=0.0, le=0.25)
    """Largest relative distance between the sketches of two replicas of the same numeric class (device and
    dtype) that still agree. Honest float32 replicas measured at most 0.0017; the nearest attack 0.37."""
    mixed_tolerance: float = Field(default=0.15, gt=0.0, le=0.25)
    """The same between replicas of different numeric classes (float32 vs bfloat16 measured 0.03 to 0.13 after
    the first rounds)."""
    grace_rounds: int = Field(default=5, ge=0)
    """Rounds at the start of a run in which replicas of different numeric classes get the largest tolerance,
    0.25: while the loss falls fast, float32 and bfloat16 replicas differ most (measured up to 0.22)."""
    round_warmup_steps: int = Field(default=5, ge=0)
    """A verifiable round starts a fresh AdamW (so that replicas agree), whose first steps are large: the
    inner learning rate ramps up over this many steps of every round. Measured on the default experiment (4
    simulated peers, 16 rounds of 15 steps, bench.simulate): val loss 2.147 without, 2.020 with 3, 1.868
    with 5, 1.877 with 8; an AdamW kept across rounds (no verification) 1.802."""
    reveal_timeout_s: float = Field(default=60.0, gt=0.0, le=MAX_SECONDS)
    """How long a replica waits for its groupmates' nonces and sketches before it judges without them (a
    peer that does not reveal is left out of the round)."""


SWARM_KEY_RE = re.compile(r"[0-9a-fA-F]{64}")  # upper case too: the same bytes, copied from another tool


KEY_FILE_MAX_BYTES = 4096


def read_key_file(path: Path) -> bytes:
    """The swarm key in ``path``, or ``ValueError`` naming ``swarm.key_file`` and what is wrong. Checked when
    the config is loaded, so that `p2ptrain config validate` and every command refuse a bad key before they
    start anything (``membership.read_swarm_key`` reads it for the DHT)."""
    try:
        raw = read_at_most(path, KEY_FILE_MAX_BYTES)  # a key is 64 digits
        if raw is None:
            raise ValueError(
                f"swarm.key_file {path}: not a swarm key (over {KEY_FILE_MAX_BYTES} bytes: a key is 64 "
                "hexadecimal digits, made by `p2ptrain keygen`)"
            )
        text = raw.decode().strip()
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or e
        raise ValueError(f"swarm.key_file {path}: cannot read it ({reason})") from None
    if not SWARM_KEY_RE.fullmatch(text):
        raise ValueError(
            f"swarm.key_file {path}: not a swarm key (64 hexadecimal digits: make one with `p2ptrain keygen`)"
        )
    return bytes.fromhex(text)


class SwarmConfig(_Section):
    initial_peers: list[str] = []
    """Multiaddrs of peers already in the swarm, each with its peer id, e.g.
    /ip4/203.0.113.5/tcp/31337/p2p/12D3Koo... (as a peer prints it). Empty: start a new swarm."""
    initial_peers_file: Path | None = None
    """Also read initial peers from this file (one multiaddr with its /p2p/ peer id per line), waiting up to
    swarm.bootstrap_timeout_s for it to appear: `p2ptrain dht --maddrs-file` writes it (docker-compose)."""
    host_maddrs: list[str] = ["/ip4/0.0.0.0/tcp/0"]
    """Addresses to listen on. The default listens on all interfaces at a random port; pin a port
    (e.g. /ip4/0.0.0.0/tcp/31337) to open it in a firewall."""
    announce_maddrs: list[str] = []
    """Public addresses to tell other peers, when they differ from the listening ones (NAT, port forwarding)."""
    identity_path: Path | None = None
    """File holding this peer's private key: created on first use, it keeps the peer id stable across restarts.
    The same key signs the peer's progress record. None: a new identity each start."""
    key_file: Path | None = None
    """The swarm key (`p2ptrain keygen FILE` makes one; share it with the swarm's peers, bootstrap nodes and
    status readers, over a channel you trust). Only holders can read or write the run's records, join its
    all-reduce or download its state. None: an open swarm that anyone who can reach a peer may join (each
    peer says so at start)."""
    client_mode: bool = False
    """Run without accepting incoming connections (behind a NAT without port forwarding). Such a peer still
    trains and sends its pseudo-gradients, but cannot serve as a reducer or state donor."""
    use_relay: bool = True
    """Allow connections through libp2p circuit relays."""
    use_auto_relay: bool = False
    """Look for relays automatically and advertise relayed addresses (for peers behind NAT)."""
    nat_port_map: bool = True
    """Ask the home router to forward this peer's port (UPnP / NAT-PMP). Always off when every host_maddrs
    address is loopback (the demo, the tests): then nothing leaves 127.0.0.1."""
    bootstrap_timeout_s: float = Field(default=30.0, gt=0.0, le=MAX_SECONDS)
    """Give up joining if no initial peer answers within this time."""
    min_peers: int = Field(default=1, ge=1)
    """Before its first round, wait until this many peers (this one included) are in the swarm. The demo sets
    it to its number of peers so that nobody trains ahead alone."""
    min_peers_timeout_s: float = Field(default=300.0, gt=0.0, le=MAX_SECONDS)
    """Stop waiting for swarm.min_peers after this long and start with whoever is there."""
    heartbeat_s: float = Field(default=2.0, gt=0.0, le=MAX_SECONDS)
    """How often a peer publishes its progress record. A change of state, round or params goes out at once,
    pushed to every peer it knows; samples and throughput ride on the next push, which comes at least every
    record_ttl_s / 3, when the signed copy in the DHT is refreshed too."""
    record_ttl_s: float = Field(default=20.0, gt=0.0, le=300.0)
    """A peer not heard from (pushed or read in the DHT) for this long is considered gone. At most 300: no
    node of any swarm keeps a record longer than 600 s, whatever it asks for."""
    state_download_timeout_s: float = Field(default=60.0, gt=0.0, le=MAX_SECONDS)
    """Give up downloading the swarm's state from one donor after this long and try the next."""
    catch_up_timeout_s: float = Field(default=120.0, gt=0.0, le=MAX_SECONDS)
    """A peer behind the swarm never trains a round the swarm has left behind: it asks the live peers that
    hold the swarm's newer state (with backoff), or waits for one to come back. If it has not got that state
    after this long (its holders crashed, or cannot serve it), it goes on from its own state when it is one
    round behind (that round's progress is lost, not forked), and stops with exit code 3 when it is further
    behind. If the swarm has finished the run and nobody serves its final state, it stops at once. Must be
    shorter than averaging.barrier_timeout_s."""
    linger_s: float = Field(default=300.0, ge=0.0, le=MAX_SECONDS)
    """After its last round, a peer stays this long at most, serving its final state while any live peer is
    behind, loading, or finished with other params (it leaves as soon as every other live peer is done with
    the same params), so that slower peers can finish, load its state if their last sync failed, and check
    their final params against it. At least (1 + averaging.retries) x (averaging.matchmaking_timeout_s +
    averaging.allreduce_timeout_s), the longest a failed sync can take; 0: leave at once."""
    split_warning_s: float = Field(default=120.0, gt=0.0, le=MAX_SECONDS)
    """Warn in the logs when other peers have seen a different set of live peers than this one, or a round
    two or more apart, for this long: a sign that the swarm's DHT is split or that peers cannot reach
    each other."""

    @field_validator("initial_peers", "host_maddrs", "announce_maddrs")
    @classmethod
    def _check_maddrs(cls, values: list[str]) -> list[str]:
        for value in values:
            parse_multiaddr(value)
        return values

    @field_validator("initial_peers")
    @classmethod
    def _check_peer_ids(cls, values: list[str]) -> list[str]:
        for value in values:
            check_peer_maddr(value)
        return values

    @model_validator(mode="after")
    def _check_key_file(self) -> SwarmConfig:
        if self.key_file is not None:
            read_key_file(self.key_file)
        return self

    @model_validator(mode="after")
    def _check_ttl(self) -> SwarmConfig:
        if self.record_ttl_s < 2 * self.heartbeat_s:
            raise ValueError("swarm.record_ttl_s must be at least twice swarm.heartbeat_s")
        if self.split_warning_s <= self.record_ttl_s + 2 * self.heartbeat_s:
            # Views legitimately differ until a departed peer's record expires and a new one has spread.
            raise ValueError("swarm.split_warning_s must exceed swarm.record_ttl_s + 2 * swarm.heartbeat_s")
        return self


class DeviceConfig(_Section):
    kind: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """Where inner steps run. 'auto' picks mps (Apple Silicon), then cuda, then cpu."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Autocast dtype of the inner forward pass. Master params and pseudo-gradients stay float32 on CPU."""
    num_threads: int | None = Field(default=None, ge=1, le=4096)
    """Cap on torch's CPU threads (None: torch's default; at most 4096). The demo sets it so that peers share a
    machine fairly."""
    max_memory_gb: float | None = Field(default=None, gt=0.0)
    """Cap on this peer's memory, so that the volunteer's machine keeps the rest. On CUDA and MPS the
    allocator is held to it (a step that needs more fails); on any device the peer measures its processes'
    resident memory after the start-up benchmark's step (device.benchmark_steps) and after every round, and
    stops with a one-line error naming what it needs when it is over the cap. None: no cap."""
    benchmark_steps: int = Field(default=3, ge=0)
    """Inner steps of the run's model timed on a copy of it when the peer starts: its speed (samples/s and an
    estimate of FLOP/s) goes into its record, `p2ptrain status` and the metrics. 0: no benchmark."""
    evaluate_in_background: bool = True
    """Compute this peer's validation losses (data.eval_by) on a copy of the model, in a background thread,
    while the next round trains, instead of before it: the round's other peers then wait for nobody's
    evaluation at the next barrier. It costs one more copy of the model's params on the device, and the
    evaluation (its activations too) shares the device with training meanwhile. The round's log line comes
    when its evaluation ends. Never for the last round, nor on MPS (torch's MPS backend crashes when two
    threads use it at once: pytorch/pytorch#197805). false: evaluate first, then train."""


class CheckpointConfig(_Section):
    dir: Path | None = None
    """Where this peer writes its final model and checkpoints. Unset: checkpoints/<run_id>/peer-<N> under the
    working directory, N the lowest that no running peer holds, so that peers started from one checkout never
    share files and a restarted peer takes its directory back and resumes. A peer refuses to start in a
    directory that another running peer holds."""
    every_rounds: int = Field(default=0, ge=0)
    """Write a checkpoint every N rounds (0: only the final model, and interrupted.safetensors on a stop)."""
    keep_last: int = Field(default=3, ge=1)
    """Keep this many periodic checkpoints (round-*.safetensors); older ones are deleted."""
    resume: bool = True
    """On start, continue from the newest valid checkpoint in checkpoint.dir whose experiment config matches
    (params, outer momentum, round, error-feedback residual). Corrupted or mismatched files are refused
    with a warning, never loaded. If the swarm is ahead, the peer then loads the swarm's state instead."""


def parse_hours(hours: str) -> tuple[datetime.time, datetime.time]:
    """'HH:MM-HH:MM' as (start, end) local times; raises ValueError saying what is wrong."""
    start, sep, end = hours.partition("-")
    if not sep:
        raise ValueError("expected 'HH:MM-HH:MM'")
    try:
        times = datetime.time.fromisoformat(start.strip()), datetime.time.fromisoformat(end.strip())
    except ValueError:
        raise ValueError("expected 'HH:MM-HH:MM' (24-hour local times)") from None
    if any(t.tzinfo is not None for t in times):  # compared with the local clock, which has none
        raise ValueError("expected local times, without a time zone ('07:00-22:00')")
    if times[0] == times[1]:
        raise ValueError("the window starts and ends at the same time: it would never be open")
    return times


class ScheduleConfig(_Section):
    max_other_cpu: float | None = Field(default=None, gt=0.0, lt=1.0)
    """Pause while other processes use more than this share of the CPU this peer leaves free (0.5: half of
    it; near 1 when they fill the machine: 1 itself would never be passed), as read every
    schedule.check_every_s. None: never pause for load."""
    pause_on_battery: bool = False
    """Pause while the machine runs on battery (a machine without a battery never does)."""
    hours: str | None = None
    """Train only between these local times, 'HH:MM-HH:MM' (it may wrap midnight: '22:00-07:00'). None: at
    any time."""
    check_every_s: float = Field(default=5.0, gt=0.0, le=MAX_SECONDS)
    """How often the machine is read (CPU, battery, clock)."""
    resume_after_s: float = Field(default=30.0, ge=0.0, le=MAX_SECONDS)
    """Resume only once no reason to pause has shown for this long, so that a peer does not flap in and out
    of rounds; a peer that pauses again before it trained as long as it waited waits twice as long the next
    time, up to 16 times this. A paused peer stays in the swarm as 'paused': nobody waits for it, and it
    catches up when it resumes."""

    @field_validator("hours")
    @classmethod
    def _check_hours(cls, value: str | None) -> str | None:
        if value is not None:
            parse_hours(value)
        return value

    @property
    def enabled(self) -> bool:
        return self.max_other_cpu is not None or self.pause_on_battery or self.hours is not None


class LogConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level for p2ptrain (hivemind's own records are shown from 'warning' unless this is 'debug')."""
    format: Literal["auto", "json", "console"] = "auto"
    """'auto': readable lines on a terminal, JSON lines otherwise."""


class MetricsConfig(_Section):
    port: int | None = Field(default=None, ge=1, le=65535)
    """Serve Prometheus metrics at http://HOST:PORT/metrics (flag: --metrics-port). None: no metrics server."""
    host: str = "127.0.0.1"
    """Address the metrics server listens on: this machine only by default; 0.0.0.0 for every interface (a
    Prometheus on another machine or in another container)."""
    swarm_period_s: float = Field(default=10.0, gt=0.0, le=MAX_SECONDS)
    """How often `p2ptrain dht --metrics-port` reads the peers' records for the swarm-wide gauges."""


class ExperimentConfig(BaseSettings):
    """A p2ptrain experiment. All peers of a run should share every section except swarm, device and log."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
    )

    run: RunConfig = RunConfig()
    """Run identity."""
    model: ModelConfig = ModelConfig()
    """The model to train."""
    data: DataConfig = DataConfig()
    """The training corpus."""
    inner: InnerConfig = InnerConfig()
    """The local (inner) optimizer."""
    outer: OuterConfig = OuterConfig()
    """The outer optimizer and the length of the run."""
    averaging: AveragingConfig = AveragingConfig()
    """How peers find each other and average each round."""
    verification: VerificationConfig = VerificationConfig()
    """Checking peers' work by replicas (docs/architecture.md#verification)."""
    swarm: SwarmConfig = SwarmConfig()
    """Networking: how this peer joins and talks to the swarm."""
    device: DeviceConfig = DeviceConfig()
    """Local compute."""
    checkpoint: CheckpointConfig = CheckpointConfig()
    """Checkpoints and the final model."""
    schedule: ScheduleConfig = ScheduleConfig()
    """When this peer trains: its volunteer's machine comes first (docs/architecture.md#schedule)."""
    log: LogConfig = LogConfig()
    """Logging."""
    metrics: MetricsConfig = MetricsConfig()
    """Prometheus metrics (docs/deploy.md#monitoring)."""

    @model_validator(mode="after")
    def _check_model_fits_data(self) -> ExperimentConfig:
        if self.model.name.startswith("cnn-") != self.data.is_images:
            if self.data.is_images:
                raise ValueError(
                    f"model.name: {self.model.name} models text; data.source {self.data.source!r} is images: "
                    "give a cnn-* model (cnn-tiny, cnn-small, cnn-medium)"
                )
            raise ValueError(
                f"model.name: {self.model.name} classifies images; data.source {self.data.source!r} is text: "
                "give data.source digits, idx or images"
            )
        return self

    @model_validator(mode="after")
    def _check_corpus_size(self) -> ExperimentConfig:
        if self.data.source == "text" and self.data.path is not None and self.data.path.is_file():
            size, needed = (
                self.data.path.stat().st_size,
                min_corpus_bytes(self.model.context_length, self.data.val_fraction),
            )
            if size < needed:
                raise ValueError(
                    f"data.path: {self.data.path} has {size} bytes, too few for model.context_length "
                    f"{self.model.context_length} and data.val_fraction {self.data.val_fraction} "
                    f"(at least {needed} bytes)"
                )
        return self

    @model_validator(mode="after")
    def _check_training_on(self) -> ExperimentConfig:
        k = self.inner.max_steps_while_waiting
        if k and self.inner.round_seconds is not None:
            raise ValueError(
                f"inner.max_steps_while_waiting {k} is for rounds by steps: with inner.round_seconds every peer "
                "already trains until the round's deadline (set one of them)"
            )
        if k and self.verification.replicas > 1:
            raise ValueError(
                f"inner.max_steps_while_waiting {k} with verification.replicas {self.verification.replicas}: "
                "replicas of a shard do the same steps, so nobody trains on (set it to 0)"
            )
        return self

    @model_validator(mode="after")
    def _check_verification(self) -> ExperimentConfig:
        if (
            self.verification.replicas > 1
            and self.inner.round_seconds is not None
            and not self.device.benchmark_steps
        ):
            raise ValueError(
                f"inner.round_seconds with verification.replicas {self.verification.replicas} needs "
                "device.benchmark_steps > 0: replicas of a shard do the steps their slowest member's published "
                "benchmark fits in the round"
            )
        if self.verification.replicas > 1 and self.model.dropout > 0:
            raise ValueError(
                f"verification.replicas {self.verification.replicas} needs model.dropout 0 (got "
                f"{self.model.dropout}): replicas draw their dropout masks apart and would never agree"
            )
        if self.verification.replicas > 1 and self.averaging.error_feedback:
            raise ValueError(
                f"verification.replicas {self.verification.replicas} needs averaging.error_feedback false: "
                "a peer must send exactly the pseudo-gradient it sealed, not one plus its own residual"
            )
        return self

    @model_validator(mode="after")
    def _check_linger(self) -> ExperimentConfig:
        if self.swarm.catch_up_timeout_s >= self.averaging.barrier_timeout_s:
            # A peer ahead that cannot serve its state waits at its barrier for those behind, who give up on
            # it and come to its round: they must do so before its barrier gives up on them.
            raise ValueError(
                f"swarm.catch_up_timeout_s ({self.swarm.catch_up_timeout_s}) must be shorter than "
                f"averaging.barrier_timeout_s ({self.averaging.barrier_timeout_s})"
            )
        a = self.averaging
        worst_sync = (1 + a.retries) * (a.matchmaking_timeout_s + a.allreduce_timeout_s)
        if 0 < self.swarm.linger_s < worst_sync:
            # Otherwise a peer stuck in a failed last sync finds everyone gone and ends with its own params.
            raise ValueError(
                f"swarm.linger_s ({self.swarm.linger_s}) must be 0 or at least (1 + averaging.retries) x "
                f"(averaging.matchmaking_timeout_s + averaging.allreduce_timeout_s) = {worst_sync}"
            )
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, _YamlSource(settings_cls)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def training_sections(self, *, every_field: bool = False) -> dict[str, Any]:
        """The sections a run's peers share (:data:`TRAINING_SECTIONS`), as JSON: what the swarm publishes as
        its experiment (``experiment.py``). The data is named by its content (``data.sha256``), never by its
        path, which is each peer's own. A field is left out where a reader takes it as left out
        (:func:`training_defaults`: its default, but for :data:`ABSENT_MEANS`): so a release that adds a field
        leaves every run that does not set it as it was (the same experiment, the same training hash), and an
        older release can still read it. ``every_field``: with
        the defaults, as releases before 2026-12-02 wrote them."""
        from p2ptrain.data import corpus_digest  # data.py imports this module

        doc = self.model_dump(mode="json", include=set(TRAINING_SECTIONS))
        if not every_field:
            doc = leave_out_absent(doc)
        doc = {name: doc.get(name, {}) for name in TRAINING_SECTIONS}
        doc["run"]["run_id"] = self.run.run_id  # always: a published experiment is filed under it
        doc["data"].pop("path", None)
        doc["data"]["sha256"] = corpus_digest(self.data)
        return doc

    def to_json(self) -> str:
        """The whole config as JSON without the fields a reader takes as left out (a checkpoint embeds it)."""
        return json.dumps(leave_out_absent(self.model_dump(mode="json")))

    def agreed_sections(self) -> dict[str, Any]:
        """:meth:`training_sections` without :data:`OWN_FIELDS`: what every peer of a run must agree on."""
        return without_own_fields(self.training_sections())

    def training_hash(self, *, every_field: bool = False) -> str:
        """Hash of what a checkpoint and a state transfer must agree on: the run, model, data (by content),
        inner and outer sections, and the verification section in a verifiable run. ``every_field``: the
        hash as releases before 2026-12-02 computed it, over every field, defaults included
        (:meth:`resumable_hashes`)."""
        doc = without_own_fields(self.training_sections(every_field=every_field))
        shared = {name: doc[name] for name in ("run", "model", "data", "inner", "outer")}
        if (
            self.verification.replicas > 1
        ):  # only then: a run without replicas keeps its hash when it is tuned
            shared["verification"] = doc["verification"]
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]

    def resumable_hashes(self) -> frozenset[str]:
        """The training hashes of the checkpoints this peer resumes from: its own, and the one a release from
        before 2026-12-02 wrote for this experiment (it hashed every field; a checkpoint of the release
        just before this one matches it, so an upgrade mid-run resumes)."""
        return frozenset({self.training_hash(), self.training_hash(every_field=True)})


TRAINING_SECTIONS = ("run", "model", "data", "inner", "outer", "averaging", "verification")
"""The sections a run's peers share: the swarm publishes them, and a joiner takes them from it.

Releases mix: what a run publishes, hashes and embeds in its checkpoints leaves out every field at its
default, and a reader takes a field left out as its own default. So a release may add a field to these
sections whose default keeps the old behaviour (or whose absence does: :data:`ABSENT_MEANS`), and runs of
older and newer releases still agree; it must never change an existing field's default (the runs that leave
it out would then train differently under the same hash). ``tests/test_config.py`` holds the defaults as
released and fails when one changes."""


ABSENT_MEANS: dict[str, dict[str, Any]] = {
    "averaging": {"packed": False, "agreed_groups": False, "settled_groups": False},
    "outer": {"overlap": False},
}
"""Fields whose absence means other than their default: a field added with a new behaviour as its default
(new runs get it) while the runs of older releases, which leave the field out, keep the old one. Each is
left out only at this value, so a run at the default publishes it, and an older release refuses to join
rather than train with a different wire. The cost: an older release cannot read a model file with such a
field set to its default either (it names the field as a newer release's: upgrade to read it)."""


def training_defaults(sections: Iterable[str] = TRAINING_SECTIONS) -> dict[str, dict[str, Any]]:
    """Every field of ``sections`` (the training sections; any of the config's) as a field left out stands
    for it, as JSON: what a published experiment, a training hash or a checkpoint's config means by leaving a
    field out. That is its default, but for :data:`ABSENT_MEANS`."""
    return {
        name: ExperimentConfig.model_fields[name].default.model_dump(mode="json") | ABSENT_MEANS.get(name, {})
        for name in sections
    }


def leave_out_absent(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Sections (as JSON) without the fields a reader takes as left out (:func:`training_defaults`). A
    section this release does not know, or one that is not a mapping (a peer's published experiment may hold
    either), is kept as it is."""
    absent = training_defaults([name for name in doc if name in ExperimentConfig.model_fields])
    return {
        name: {k: v for k, v in fields.items() if k not in absent.get(name, {}) or absent[name][k] != v}
        if isinstance(fields, Mapping)
        else fields
        for name, fields in doc.items()
    }


OWN_SECTIONS = ("swarm", "device", "checkpoint", "schedule", "log", "metrics")
"""The sections that are each peer's own (a volunteer's machine, network and files)."""
OWN_FIELDS: dict[str, tuple[str, ...]] = {
    # How long a peer waits for others, and whom it waits for, is its own business (a slow link needs longer
    # timeouts); what goes on the wire and how reducers combine it is not.
    "averaging": (
        "min_group_size",
        "target_group_size",
        "matchmaking_time_s",
        "request_timeout_s",
        "matchmaking_timeout_s",
        "allreduce_timeout_s",
        "next_chunk_timeout_s",
        "barrier_timeout_s",
        "retries",
    ),
    "verification": ("reveal_timeout_s",),
    # How much of its own stale progress a peer keeps when an overlapped sync lands shapes only where its next
    # pseudo-gradient starts, never the master params the swarm agrees on.
    "outer": ("overlap_carry",),
}
"""Fields of the training sections that each peer may set for itself: the swarm publishes the run's values
and a joiner starts from them, but a peer that sets others is not refused."""


def without_own_fields(sections: dict[str, Any]) -> dict[str, Any]:
    """Training sections (as JSON) without :data:`OWN_FIELDS`: a copy, the input is left alone."""
    return {
        name: {k: v for k, v in fields.items() if k not in OWN_FIELDS.get(name, ())}
        if isinstance(fields, dict)
        else fields
        for name, fields in sections.items()
    }


def min_corpus_bytes(context_length: int, val_fraction: float) -> int:
    """The smallest corpus that leaves two training windows after the validation split (``data.Corpus``)."""
    size = 3 * (context_length + 1)
    while size - max(int(size * val_fraction), context_length + 1) < 2 * (context_length + 1):
        size += 1
    return size


# The YAML of the config being loaded. A context variable, not a class attribute, so that loading
# two configs (tests, the demo) never races.
_YAML_DATA: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("_YAML_DATA", default=None)


class _YamlSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_YAML_DATA.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_YAML_DATA.get() or {})


MAX_CONFIG_FILE_BYTES = 1 << 20
"""A config is a few lines; a file larger than this is not one (``/dev/zero`` would never end)."""


class _StrictLoader(yaml.SafeLoader):
    """``yaml.safe_load``, but a key given twice in one mapping is an error (YAML keeps the last, silently)."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:  # before merge keys (<<) are flattened in: a key may override a merged one
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            twice = key in seen
        except TypeError:  # an unhashable key: construct_mapping says so
            continue
        if twice:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} is given twice", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a config file into a dict of sections, with a one-line error for unreadable or malformed files."""
    path = Path(path)
    try:
        with path.open("rb") as f:  # a pipe too (--config <(...)); read no further than a config can be
            raw = f.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(
            f"config file {path}: more than {MAX_CONFIG_FILE_BYTES} bytes, too large for a config"
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {e.start})") from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    for section, fields in data.items():
        if not isinstance(section, str):
            raise ConfigError(f"{path}: {section!r} is not a section's name")
        # Refused here, not by the model: a flag that sets a key of the section would replace it unseen.
        if fields is not None and not isinstance(fields, dict):
            raise ConfigError(
                f"{path}: section {section!r} is {type(fields).__name__} {str(fields)[:40]!r}, not a mapping of its "
                "keys"
            )
    # A section whose keys are all commented out is its defaults.
    return {section: {} if fields is None else fields for section, fields in data.items()}


def parse_set(assignments: list[str]) -> dict[str, Any]:
    """Turn ``["inner.lr=3e-4", "swarm.initial_peers=[a, b]"]`` into a nested dict (values parsed as YAML)."""
    result: dict[str, Any] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        parts = key.strip().split(".")
        if len(parts) < 2 or not all(parts):
            raise ConfigError(f"--set {item!r}: the key must be section.key, e.g. inner.lr=3e-4")
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        except RecursionError:
            raise ConfigError(f"--set {key.strip()}: the value is nested too deeply") from None
        node = result
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {item!r}: {part} is set to a value and used as a section")
        node[parts[-1]] = value
    return result


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: Path | None = None, overrides: dict[str, Any] | None = None, *, base: dict[str, Any] | None = None
) -> ExperimentConfig:
    """Resolve a config from YAML, ``P2PTRAIN_`` env vars and overrides (flags, ``--set``).

    Args:
        path: a YAML file; None: the built-in defaults (the default experiment).
        overrides: a nested dict, highest precedence.
        base: in place of a YAML file: sections as a nested dict (a swarm's published experiment).

    Raises:
        ConfigError: one line per problem, each naming the field path.
    """
    data = read_yaml(path) if path is not None else (base or {})
    try:
        return _construct(data, overrides or {})
    except ValidationError as e:
        sources = _Sources(path, data, overrides or {})
        raise ConfigError(format_validation_error(e, source=sources.of)) from None


def _construct(data: dict[str, Any], overrides: dict[str, Any]) -> ExperimentConfig:
    """The config from YAML ``data``, the environment and ``overrides``; a problem with the environment is a
    ConfigError naming the variable, any other a ValidationError."""
    check_environment()
    token = _YAML_DATA.set(data)
    try:
        return ExperimentConfig(**overrides)
    except SettingsError as e:
        raise ConfigError(_environment_problem(e)) from None
    except RecursionError:  # the file's and --set's values were read before: a variable's JSON
        raise ConfigError("environment variables: a P2PTRAIN_ variable's JSON is nested too deeply") from None
    finally:
        _YAML_DATA.reset(token)


def check_fields(
    overrides: dict[str, Any], *, yaml_data: dict[str, Any] | None = None, path: Path | None = None
) -> None:
    """Check what ``overrides`` (flags, ``--set``), the environment and ``yaml_data`` (a volunteer's file at
    ``path``, which sets only its own fields) set, field by field, before the config they go into is known
    (a joiner's, before it reads the swarm's experiment): a wrong type, a value out of range, an unknown
    key. Checks between fields wait for the whole config.

    Raises:
        ConfigError: one line per problem, each naming the field path and where it was set.
    """
    try:
        _construct(yaml_data or {}, overrides)
    except ValidationError as e:
        # A field's own problem has a field's location; a check between fields has a section's, or none.
        own = [item for item in e.errors() if len(item["loc"]) >= 2 or item["type"] == "extra_forbidden"]
        if own:
            sources = _Sources(path, yaml_data or {}, overrides)
            raise ConfigError(format_errors(own, source=sources.of)) from None


def _env_field(name: str) -> tuple[str, str] | None:
    """The (section, key) a ``P2PTRAIN_<SECTION>__<KEY>`` variable sets, or None for another name."""
    if not name.upper().startswith(ENV_PREFIX):
        return None
    section, delimiter, key = name[len(ENV_PREFIX) :].lower().partition("__")
    return (section, key) if delimiter else None


def env_value(section: str, key: str) -> Any:
    """What the environment sets ``section.key`` to (``P2PTRAIN_<SECTION>__<KEY>``, or the key of a
    ``P2PTRAIN_<SECTION>`` JSON object), as written; None where it does not."""
    for name, value in os.environ.items():
        if _env_field(name) == (section, key):
            return value
    for name, value in os.environ.items():
        if name.upper() == ENV_PREFIX + section.upper():
            with contextlib.suppress(ValueError, RecursionError):
                whole = json.loads(value)
                if isinstance(whole, dict) and key in whole:
                    return whole[key]
    return None


def check_environment() -> None:
    """Refuse ``P2PTRAIN_`` variables that would be ignored: one naming no section, or a section and key
    joined by one underscore (``P2PTRAIN_INNER_LR``). A key the section lacks is refused by the config."""
    sections = list(ExperimentConfig.model_fields)
    problems = []
    for name in sorted(os.environ):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :]
        field = _env_field(name)
        if field is not None and field[0] not in sections:
            problems.append(
                f"environment variable {name}: no section {field[0]!r} (the sections: {', '.join(sections)})"
            )
        elif field is None and (head := rest.lower().partition("_"))[0] in sections and head[2]:
            keys = list(getattr(ExperimentConfig.model_fields[head[0]].annotation, "model_fields", {}))
            fix = (
                f"{ENV_PREFIX}{head[0].upper()}__{head[2].upper()}"
                if head[2] in keys
                else f"{ENV_PREFIX}{head[0].upper()}__<KEY>, a key of {', '.join(keys)}"
            )
            problems.append(
                f"environment variable {name}: a section and its key are joined by two underscores: {fix}"
            )
    if problems:
        raise ConfigError("\n".join(problems))


def _is_collection(annotation: Any) -> bool:
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_is_collection(arg) for arg in get_args(annotation))
    return get_origin(annotation) in (list, tuple, set, frozenset, dict) or annotation in (list, tuple, dict)


def _environment_problem(error: SettingsError) -> str:
    """pydantic-settings' error for a variable it cannot parse, as one line naming the variable: a list or
    mapping field takes JSON (``P2PTRAIN_SWARM__INITIAL_PEERS='["/ip4/..."]'``)."""
    sections = {ENV_PREFIX + name.upper(): name for name in ExperimentConfig.model_fields}
    for name, value in sorted(os.environ.items()):
        if name.upper() in sections:  # a whole section, which pydantic-settings reads as JSON
            try:
                json.loads(value)
            except ValueError:
                whole = {"lr": 0.0003} if sections[name.upper()] == "inner" else {"key": "value"}
                return (
                    f"environment variable {name}: a whole section is JSON, e.g. {name}='{json.dumps(whole)}', "
                    f"or set one key: {name.upper()}__<KEY> (got {value[:40]!r})"
                )
        field = _env_field(name)
        section = ExperimentConfig.model_fields.get(field[0]) if field else None
        if field is None or section is None or not isinstance(section.annotation, type):
            continue
        info = getattr(section.annotation, "model_fields", {}).get(field[1])
        if info is None or not _is_collection(info.annotation):
            continue
        try:
            json.loads(value)
        except ValueError:
            example = info.default or [
                "/ip4/203.0.113.5/tcp/31337" + ("/p2p/12D3Koo..." if field[1] == "initial_peers" else "")
            ]
            return (
                f"environment variable {name}: give JSON, e.g. {name}='{json.dumps(example)}' (got {value!r})"
            )
    return f"environment variables: {str(error).splitlines()[0]}"


class _Sources:
    """Which source set a field: the command line, an environment variable, or the YAML file."""

    def __init__(self, path: Path | None, yaml_data: dict[str, Any], overrides: dict[str, Any]):
        self.path, self.yaml_data, self.overrides = path, yaml_data, overrides

    def of(self, loc: tuple) -> str | None:
        keys = [str(part) for part in loc]
        if not keys:
            return str(self.path) if self.path else None
        if _has(self.overrides, keys):
            return "command line"
        for name in sorted(os.environ):
            if (
                len(keys) > 1
            ):  # P2PTRAIN_INNER__LR, P2PTRAIN_INNER__LR__X (nested in it), P2PTRAIN_INNER's JSON
                field = _env_field(name)
                if (field is not None and field[0] == keys[0] and field[1].split("__")[0] == keys[1]) or (
                    name.upper() == ENV_PREFIX + keys[0].upper() and env_value(*keys[:2]) is not None
                ):
                    return f"environment variable {name}"
            elif name.upper() == ENV_PREFIX + keys[0].upper():  # a section's own check: only its JSON
                return f"environment variable {name}"
        if self.path is not None and _has(self.yaml_data, keys[:1]):
            return str(self.path)
        return None


def _has(data: dict[str, Any], keys: list[str]) -> bool:
    node: Any = data
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return False
        node = node[key]
    return True


def format_validation_error(error: ValidationError, source: Any = None) -> str:
    """One line per problem, each naming the field and, when known, where its value came from.

    Args:
        source: a string (every problem's source), or a function of the field's location that returns one.
    """
    return format_errors(error.errors(), source)


def format_errors(errors: Iterable[Any], source: Any = None) -> str:
    """:func:`format_validation_error` for a selection of a ``ValidationError``'s ``errors()``."""
    lines = []
    for item in errors:
        where = ".".join(str(part) for part in item["loc"])
        message = item["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        if item["type"] == "extra_forbidden":
            message = "unknown key"
        elif "input" in item and item["type"] not in ("missing",) and not isinstance(item["input"], dict):
            got = repr(item["input"])
            message = f"{message} (got {got if len(got) <= 80 else got[:72] + '...' + got[-5:]})"
        origin = source(tuple(item["loc"])) if callable(source) else source
        prefix = f"{origin}: " if origin else ""
        if message.startswith(f"{where}."):  # a section's own check already names its field
            where = ""
        lines.append(f"{prefix}{where}: {message}" if where else f"{prefix}{message}")
    return "\n".join(lines)


def reference_markdown() -> str:
    """The config reference (docs/config.md), generated from the field docstrings."""
    out = [
        "# Configuration reference",
        "",
        "Generated by `p2ptrain config reference` from `p2ptrain/config.py`; do not edit by hand.",
        "",
        "Precedence, highest first: command-line flags and `--set section.key=value`; environment variables",
        "`P2PTRAIN_<SECTION>__<KEY>` (for example `P2PTRAIN_INNER__LR=3e-4`); the YAML file; the defaults below.",
        "Unknown keys are errors, and so is a `P2PTRAIN_<SECTION>__<KEY>` variable of no section, or one that joins",
        "a section and its key with one underscore (`P2PTRAIN_INNER_LR`). `P2PTRAIN_<SECTION>` sets a whole section",
        "as JSON; other `P2PTRAIN_` names are not read. A list set by a variable is JSON:",
        "`P2PTRAIN_SWARM__INITIAL_PEERS='[\"/ip4/203.0.113.5/tcp/31337/p2p/12D3Koo...\"]'`.",
        "",
        f"Every duration (a key ending in `_s`, and `inner.round_seconds`) is at most {MAX_SECONDS:,.0f} s.",
        "",
    ]
    for section_name, section_field in ExperimentConfig.model_fields.items():
        section_cls = section_field.annotation
        assert isinstance(section_cls, type) and issubclass(section_cls, BaseModel)
        out += [f"## `{section_name}`", "", section_field.description or "", ""]
        out += ["| key | default | description |", "| --- | --- | --- |"]
        for name, field in section_cls.model_fields.items():
            default = json.dumps(field.default, default=str)
            doc = " ".join((field.description or "").split())
            out.append(f"| `{section_name}.{name}` | `{default}` | {doc} |")
        out.append("")
    return "\n".join(out)
