"""The ``p2ptrain`` command.

Exit codes: 0 success (also after a clean stop on SIGINT/SIGTERM), 1 runtime failure (swarm
unreachable, a bad model file), 2 usage or config error, 3 the peer ended without the swarm's final model
(left behind by the swarm, or diverged from it: restarting it does not help; the systemd unit does not).
Errors are one line on stderr, no traceback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from p2ptrain.addrs import SwarmError, check_writable, is_loopback, write_maddrs_file
from p2ptrain.config import (
    OWN_FIELDS,
    TRAINING_SECTIONS,
    ConfigError,
    ExperimentConfig,
    check_fields,
    deep_merge,
    env_value,
    load_config,
    parse_set,
    read_yaml,
    reference_markdown,
)
from p2ptrain.prepare import DEFAULT_SHARD_TOKENS

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train one model together on machines you already own: peer-to-peer DiLoCo over a hivemind DHT.",
)
config_app = typer.Typer(no_args_is_help=True, help="Inspect and check experiment configs.")
app.add_typer(config_app, name="config")

EXIT_RUNTIME, EXIT_USAGE, EXIT_NOT_FINAL = 1, 2, 3

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", "-c", help="Experiment YAML (default: the built-in default experiment)."),
]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override any config key: --set inner.lr=3e-4 (repeatable).")
]
MaddrsOpt = Annotated[list[str] | None, typer.Option(help="Multiaddr (repeatable, or comma-separated).")]
LogLevelOpt = Annotated[str | None, typer.Option(help="debug | info | warning | error.")]
LogFormatOpt = Annotated[str | None, typer.Option(help="auto | json | console.")]
MetricsPortOpt = Annotated[
    int | None, typer.Option(help="Serve Prometheus metrics on this port at /metrics (metrics.port).")
]
RunIdOpt = Annotated[
    str | None,
    typer.Option(
        help="The run to watch (run.run_id; status, and dht's metrics: by default the swarm's only published "
        "run, or for status the config's run.run_id where it publishes none; where it trains several, name one)."
    ),
]
DataPathOpt = Annotated[
    Path | None,
    typer.Option(
        help="This machine's copy of the run's data (data.path), where the model file names another machine's "
        "path; it must hold what the run trained on."
    ),
]
KeyFileOpt = Annotated[
    Path | None, typer.Option(help="The swarm key (swarm.key_file; `p2ptrain keygen` makes one).")
]


def fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _split(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [part for value in values for part in value.replace(",", " ").split()]


def swarm_flags(
    initial_peers: list[str] | None,
    host_maddrs: list[str] | None,
    announce_maddrs: list[str] | None,
    identity_path: Path | None,
    key_file: Path | None,
    client_mode: bool | None = None,
) -> dict[str, Any]:
    """The swarm section's command-line flags as config overrides (None: not given)."""
    return dict(
        initial_peers=_split(initial_peers),
        host_maddrs=_split(host_maddrs),
        announce_maddrs=_split(announce_maddrs),
        identity_path=identity_path,
        key_file=key_file,
        client_mode=client_mode,
    )


def _status_listen_addr(initial_peers: list[str]) -> str:
    loopback = initial_peers and all(is_loopback(m) for m in initial_peers)
    return "/ip4/127.0.0.1/tcp/0" if loopback else "/ip4/0.0.0.0/tcp/0"


def overrides_of(sets: list[str] | None, flags: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``--set`` and flags as one nested dict of overrides (flags win); ConfigError becomes exit 2."""
    try:
        overrides = deep_merge(parse_set(sets or []), {})
    except ConfigError as e:
        raise fail(str(e), EXIT_USAGE) from None
    for section, values in flags.items():
        values = {k: v for k, v in values.items() if v is not None}
        if values:
            overrides = deep_merge(overrides, {section: values})
    return overrides


def resolve(config: Path | None, sets: list[str] | None, flags: dict[str, dict[str, Any]]) -> Any:
    """Config from file + env + flags; ConfigError becomes exit 2 with the field path."""
    overrides = overrides_of(sets, flags)
    try:
        return load_config(config, overrides)
    except ConfigError as e:
        raise fail(str(e).replace("\n", "\nerror: "), EXIT_USAGE) from None


def writable(path: Path | None, flag: str) -> None:
    """Refuse an output path that cannot be written (a folder, a missing folder that cannot be made) before
    the work that ends in it."""
    if path is None:
        return
    try:
        check_writable(path)
    except OSError as e:
        raise fail(f"{flag} {path}: cannot write it ({e.strerror or e})", EXIT_USAGE) from None


def is_folder(path: Path) -> bool:
    """``path.is_dir()``, False where the path cannot even be looked at (a name too long, a folder we may not
    enter): what then reads or makes it says why, in one line."""
    try:
        return path.is_dir()
    except OSError:
        return False


def is_file(path: Path) -> bool:
    """``path`` exists and is not a folder (as :func:`is_folder`, False where it cannot be looked at)."""
    try:
        return path.exists() and not path.is_dir()
    except OSError:
        return False


def output_folder(path: Path, flag: str) -> None:
    """Refuse an output folder that is a file, or cannot be made, before the work that fills it."""
    if is_file(path):
        raise fail(f"{flag} {path}: is a file, not a folder", EXIT_USAGE)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise fail(f"{flag} {path}: cannot make it ({e.strerror or e})", EXIT_USAGE) from None


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        return read_yaml(path)
    except ConfigError as e:
        raise fail(str(e), EXIT_USAGE) from None


def own_settings_only(path: Path) -> bool:
    """Whether a config file sets only what is a peer's own (its swarm, device, checkpoint, schedule, log and
    metrics sections, the training sections' own fields such as timeouts and group sizes, and at most
    run.run_id): a volunteer's file, which joins the swarm's experiment."""
    data = read_config_file(path)  # every section a mapping (config.read_yaml)
    own = {**OWN_FIELDS, "run": ("run_id",)}
    return all(
        set(fields) <= set(own.get(section, ()))
        for section, fields in data.items()
        if section in TRAINING_SECTIONS
    )


def swarm_experiment(
    overrides: dict[str, Any], own: dict[str, Any] | None = None, path: Path | None = None
) -> Any:
    """The config of the experiment the swarm at ``--initial-peers`` trains, with this peer's own sections
    from ``overrides`` (flags, ``--set``), the environment and ``own`` (a volunteer's config file at
    ``path``), in that order of precedence: a reader DHT fetches the run's signed experiment
    (``experiment.py``), then leaves.

    Returns None when no initial peers are given (this peer starts a new swarm).
    """
    own = own or {}
    try:
        # The joiner's own settings first: a typo is refused before the swarm is asked for anything.
        check_fields(overrides, yaml_data=own, path=path)
        swarm_cfg = load_config(
            None, {"swarm": overrides.get("swarm", {})}, base={"swarm": own.get("swarm", {})}
        ).swarm
    except ConfigError as e:
        raise fail(str(e).replace("\n", "\nerror: "), EXIT_USAGE) from None
    if not (swarm_cfg.initial_peers or swarm_cfg.initial_peers_file):
        return None
    from p2ptrain import logs
    from p2ptrain.experiment import config_for, peers_count

    logs.configure("error", (overrides.get("log") or {}).get("format") or "auto")
    run_id = (
        (overrides.get("run") or {}).get("run_id")
        or env_value("run", "run_id")
        or own.get("run", {}).get("run_id")
    )
    # A reader, as `status` is: a DHT client that serves nothing and maps no ports.
    reader = swarm_cfg.model_copy(
        update=dict(
            client_mode=True,
            nat_port_map=False,
            identity_path=None,
            host_maddrs=[_status_listen_addr(list(swarm_cfg.initial_peers))],
        )
    )
    found = _published_experiment(reader, run_id)
    if found is None:
        which = f"run {run_id}" if run_id else "any run"
        raise fail(
            f"the swarm publishes no experiment for {which} (its peers may run an older p2ptrain, or have "
            "left): pass the run's config with --config (and --set averaging.packed=false for a run started "
            "before 2026-12-03, whose peers send tensor by tensor)",
            EXIT_RUNTIME,
        )
    try:
        cfg = config_for(found, overrides, own)
    except ConfigError as e:
        raise fail(str(e), EXIT_USAGE) from None
    typer.echo(
        f"Joining the swarm's experiment {found.run_id} (published by {found.owner[-8:]}, carried by "
        f"{peers_count(len(found.publishers))}): model {cfg.model.name}, {cfg.outer.num_rounds} rounds of "
        f"{cfg.inner.num_inner_steps} inner steps."
    )
    return cfg


def _published_experiment(reader: Any, run_id: str | None) -> Any:
    """The experiment of ``run_id`` (None: the only run) the swarm publishes, or None: read by a DHT client
    (``reader``, a swarm config) that leaves once it has read it.

    Raises:
        typer.Exit: the swarm trains several runs and ``run_id`` is None, or the DHT cannot be read.
    """
    from p2ptrain.experiment import ExperimentError, choose
    from p2ptrain.swarm import create_dht, progress_validators, published_experiments

    try:
        node = create_dht(reader, record_validators=progress_validators(None))
    except SwarmError as e:
        raise fail(str(e), EXIT_RUNTIME) from None
    try:
        # A record takes a moment to reach a node that just joined: look a few times before giving up.
        deadline = time.monotonic() + 2 * reader.heartbeat_s + 3
        while (found := choose(published_experiments(node), run_id)) is None and time.monotonic() < deadline:
            time.sleep(0.5)
        return found
    except ExperimentError as e:
        raise fail(str(e), EXIT_USAGE) from None
    except Exception as e:  # hivemind's own zoo, from a DHT read that failed: one line, not a traceback
        raise fail(
            f"could not read the swarm's experiment: {str(e).strip() or type(e).__name__}", EXIT_RUNTIME
        ) from None
    finally:
        node.shutdown()


def join_line(maddr: str, cfg: ExperimentConfig, *, run_id: bool) -> str:
    """The command a joiner runs, complete as printed: the experiment comes from the swarm; what only the
    joiner has (the swarm's key, its copy of the data), it must give. ``run_id``: name the run (a bootstrap
    node told which run it watches; a peer's swarm may train others)."""
    line = f"p2ptrain join --initial-peers {maddr}"
    if cfg.swarm.key_file:
        line += f" --key-file {cfg.swarm.key_file}"
    if run_id:
        line += f" --run-id {cfg.run.run_id}"
    if cfg.data.source in ("text", "prepared", "idx", "images") and cfg.data.path is not None:
        line += f" --set data.path=<your copy of {cfg.data.path.name}>"
    return line


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGINT and SIGTERM ask for a clean stop; a second signal while stopping exits at once."""

    def handler(signum, _frame):
        if stop.is_set():
            sys.stderr.write("error: second signal, exiting without a clean shutdown\n")
            raise SystemExit(128 + signum)
        sys.stderr.write(f"{signal.Signals(signum).name}: stopping (send it again to exit at once)\n")
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


ExitWithParentOpt = Annotated[
    bool,
    typer.Option(
        "--exit-with-parent",
        hidden=True,
        help="Stop, as on SIGTERM, when the process that started this one exits (the demo and tests use it).",
    ),
]


def exit_with_parent() -> None:
    """Send ourselves SIGTERM (a clean stop, through :func:`install_stop_handlers`) once the process that
    started us is gone: a demo or test run that is killed takes its peers with it.

    The starter names itself in ``P2PTRAIN_PARENT_PID`` (``localswarm.PeerProcess`` does): one killed while we
    were still starting up (seconds of imports) has already handed us to init, and our parent then would be
    init, which never exits: a peer trained to its last round with nobody to stop it."""
    from p2ptrain.procs import PARENT_PID_ENV, on_parent_exit

    named = os.environ.pop(PARENT_PID_ENV, "")  # ours only: not our children's
    parent = int(named) if named.isascii() and named.isdigit() else os.getppid()

    def stop() -> None:
        # Our output went to pipes that it read: written to now, they would break the clean stop.
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.kill(os.getpid(), signal.SIGTERM)

    on_parent_exit(parent, stop)


@app.command()
def join(
    config: ConfigOpt = None,
    initial_peers: MaddrsOpt = None,
    host_maddrs: MaddrsOpt = None,
    announce_maddrs: MaddrsOpt = None,
    identity_path: Annotated[Path | None, typer.Option(help="Private key file: a stable peer id.")] = None,
    key_file: KeyFileOpt = None,
    client_mode: Annotated[bool | None, typer.Option(help="Accept no incoming connections.")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda | mps.")] = None,
    rounds: Annotated[int | None, typer.Option(help="outer.num_rounds.")] = None,
    run_id: Annotated[
        str | None, typer.Option(help="run.run_id: the run to join, where the swarm trains several.")
    ] = None,
    set_: SetOpt = None,
    log_level: LogLevelOpt = None,
    log_format: LogFormatOpt = None,
    metrics_port: MetricsPortOpt = None,
    with_parent: ExitWithParentOpt = False,
) -> None:
    """Train with the swarm. Without --initial-peers, start a new swarm and print the address others join.
    With --initial-peers and no --config, train the experiment the swarm publishes."""
    flags = {
        "run": dict(run_id=run_id),
        "swarm": swarm_flags(
            initial_peers, host_maddrs, announce_maddrs, identity_path, key_file, client_mode
        ),
        "device": dict(kind=device),
        "outer": dict(num_rounds=rounds),
        "log": dict(level=log_level, format=log_format),
        "metrics": dict(port=metrics_port),
    }
    cfg = None
    if config is None or own_settings_only(config):
        # Without training sections of our own, we train the swarm's experiment (when we join one).
        own = read_config_file(config) if config is not None else {}
        cfg = swarm_experiment(overrides_of(set_, flags), own, config)
    if cfg is None:
        cfg = resolve(config, set_, flags)
    from p2ptrain import logs

    logs.configure(cfg.log.level, cfg.log.format, run_id=cfg.run.run_id)
    from p2ptrain.trainer import Outcome, Trainer

    stop = threading.Event()
    install_stop_handlers(stop)
    if with_parent:
        exit_with_parent()
    clog = logs.get_logger("p2ptrain.cli")
    clog.debug("config", **cfg.model_dump(mode="json"))  # the whole resolved config: `--log-level debug`
    clog.info(
        "config",
        file=str(config)
        if config
        else (
            "the swarm's experiment"
            if cfg.swarm.initial_peers or cfg.swarm.initial_peers_file
            else "built-in default experiment"
        ),
        run_id=cfg.run.run_id,
        model=cfg.model.name,
        rounds=cfg.outer.num_rounds,
        inner_steps=cfg.inner.num_inner_steps,
        compression=cfg.averaging.compression,
        config_hash=cfg.training_hash(),
    )

    def announce(maddrs: list[str]) -> None:
        new_swarm = not (cfg.swarm.initial_peers or cfg.swarm.initial_peers_file)
        if new_swarm:
            typer.echo(f"Started a new swarm for run {cfg.run.run_id}. Others join it with:")
        else:
            typer.echo("Joined the swarm. Others can also join through this peer:")
        for maddr in maddrs:
            typer.echo(f"  {join_line(maddr, cfg, run_id=False)}")
        if new_swarm and cfg.swarm.min_peers <= 1:
            typer.echo(
                f"This peer trains alone until others join ({cfg.outer.num_rounds} rounds); "
                "--set swarm.min_peers=2 waits for one first."
            )
        sys.stdout.flush()

    trainer = Trainer(cfg, stop=stop, on_started=announce)
    try:
        result = trainer.run()
    except SwarmError as e:
        raise fail(str(e), EXIT_RUNTIME) from None
    except ValueError as e:  # user-facing problems found at setup (device not available, corpus too small)
        raise fail(str(e), EXIT_USAGE) from None
    if not result.ok:  # it ended without the swarm's final model: say so, and never as final.safetensors
        raise fail(result.reason, EXIT_NOT_FINAL)
    if result.outcome == Outcome.FINAL:
        typer.echo(f"Final model: {result.path}")
    elif result.reason != "stopped":  # it stopped itself (over its memory cap): say why, and fail
        raise fail(f"{result.reason} (this peer's state is in {result.path})", EXIT_RUNTIME)
    else:
        typer.echo(f"Stopped; this peer's state is in {result.path} (started again, it resumes from it)")


@app.command()
def dht(
    initial_peers: MaddrsOpt = None,
    host_maddrs: MaddrsOpt = None,
    announce_maddrs: MaddrsOpt = None,
    identity_path: Annotated[Path | None, typer.Option(help="Private key file: a stable peer id.")] = None,
    key_file: KeyFileOpt = None,
    run_id: RunIdOpt = None,
    metrics_port: MetricsPortOpt = None,
    maddrs_file: Annotated[
        Path | None,
        typer.Option(help="Write this node's multiaddrs here (peers read it: swarm.initial_peers_file)."),
    ] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    log_level: LogLevelOpt = None,
    log_format: LogFormatOpt = None,
    with_parent: ExitWithParentOpt = False,
) -> None:
    """Run a long-lived bootstrap node that does not train. Peers pass its address as --initial-peers.

    It validates and stores the run's records like any peer; with --metrics-port it also exports the
    swarm-wide gauges (peers alive, swarm round, samples per second) read from them.
    """
    cfg = resolve(
        config,
        set_,
        {
            "run": dict(run_id=run_id),
            "swarm": swarm_flags(initial_peers, host_maddrs, announce_maddrs, identity_path, key_file),
            "log": dict(level=log_level, format=log_format),
            "metrics": dict(port=metrics_port),
        },
    )
    from p2ptrain import logs, telemetry
    from p2ptrain.swarm import create_dht, live_records, progress_validators

    if (
        maddrs_file is not None
    ):  # before the DHT starts: a file it cannot write is a one-line error, not a restart loop
        try:
            check_writable(maddrs_file)
        except OSError as e:
            raise fail(
                f"--maddrs-file {maddrs_file}: cannot write it ({e.strerror or e})", EXIT_RUNTIME
            ) from None
    logs.configure(cfg.log.level, cfg.log.format, run_id=cfg.run.run_id)
    stop = threading.Event()
    install_stop_handlers(stop)
    if with_parent:
        exit_with_parent()
    try:
        node = create_dht(cfg.swarm, record_validators=progress_validators(cfg.run.run_id))
    except SwarmError as e:
        raise fail(str(e), EXIT_RUNTIME) from None
    monitor = None
    try:
        typer.echo("DHT node running. Peers join with:")
        maddrs = [str(m) for m in node.get_visible_maddrs()]
        for maddr in maddrs:
            typer.echo(f"  {join_line(maddr, cfg, run_id='run_id' in cfg.run.model_fields_set)}")
        sys.stdout.flush()
        if maddrs_file is not None:
            try:
                write_maddrs_file(maddrs_file, maddrs)
            except OSError as e:
                raise fail(
                    f"--maddrs-file {maddrs_file}: cannot write it ({e.strerror or e})", EXIT_RUNTIME
                ) from None
        if cfg.metrics.port:
            # Swarm-wide series only: a node that does not train exports no loss, throughput or round of its own.
            try:
                telemetry.serve(cfg.metrics.port, cfg.metrics.host, registry=telemetry.NODE)
            except ConfigError as e:
                raise fail(str(e), EXIT_USAGE) from None
            named = "run_id" in cfg.run.model_fields_set
            telemetry.set_peer_info(
                peer_id=node.peer_id.to_base58(), run_id=cfg.run.run_id if named else "", device="none"
            )
            watch = _watched_run(node, cfg.run.run_id if named else None)
            monitor = telemetry.SwarmMonitor(
                lambda: live_records(node, run) if (run := watch()) else {}, cfg.metrics.swarm_period_s
            )
            monitor.start()
            logs.get_logger("p2ptrain.cli").info(
                "serving metrics",
                port=cfg.metrics.port,
                host=cfg.metrics.host,
                watching=cfg.run.run_id if named else "the swarm's only published run",
            )
        while not stop.wait(1.0):
            if not node.is_alive():
                raise fail("the DHT process died", EXIT_RUNTIME)
    finally:
        if monitor is not None:
            monitor.stop()
        if node.is_alive():
            node.shutdown()
        if maddrs_file is not None:  # a stale address would pass for this node's (compose's healthcheck)
            maddrs_file.unlink(missing_ok=True)


def _watched_run(node: Any, run_id: str | None) -> Callable[[], str | None]:
    """The run whose records a bootstrap node's metrics follow: ``run_id``, or where it was not told which,
    the swarm's only published run (as a joiner and ``status`` take it), looked up at each reading: the
    node starts before anyone publishes. None while there is none, or several (it says so, once)."""
    from p2ptrain import logs
    from p2ptrain.experiment import ExperimentError, choose
    from p2ptrain.swarm import published_experiments

    said: set[str] = set()

    def watched() -> str | None:
        if run_id is not None:
            return run_id
        try:
            found = choose(published_experiments(node), None)
        except ExperimentError as e:
            if str(e) not in said:
                said.add(str(e))
                logs.get_logger("p2ptrain.cli").warning("metrics follow no run", reason=str(e))
            return None
        return None if found is None else found.run_id

    return watched


@app.command()
def status(
    initial_peers: MaddrsOpt = None,
    key_file: KeyFileOpt = None,
    run_id: RunIdOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (for scripts).")] = False,
) -> None:
    """Show the swarm: each live peer's state, device, round, throughput and contribution; the global round."""
    cfg = resolve(
        config,
        set_,
        {
            "run": dict(run_id=run_id),
            # A reader: a DHT client that serves nothing and maps no ports; on loopback when the swarm is.
            "swarm": dict(
                initial_peers=_split(initial_peers),
                key_file=key_file,
                client_mode=True,
                nat_port_map=False,
                host_maddrs=[_status_listen_addr(_split(initial_peers) or [])],
            ),
            "log": dict(level="error"),
        },
    )
    if not (cfg.swarm.initial_peers or cfg.swarm.initial_peers_file):
        raise fail(
            "--initial-peers is required: the address of any peer or DHT node of the swarm", EXIT_USAGE
        )
    from p2ptrain import logs
    from p2ptrain.status import render, summarize
    from p2ptrain.swarm import create_dht, live_records, progress_validators

    logs.configure("error", "json" if as_json else cfg.log.format)
    # Never a peer's identity (the image sets P2PTRAIN_SWARM__IDENTITY_PATH for its peer): a new one.
    reader = cfg.swarm.model_copy(update=dict(identity_path=None))
    if "run_id" not in cfg.run.model_fields_set:  # the swarm's only run, as a joiner takes it
        found = _published_experiment(reader, None)
        if found is not None:
            cfg.run.run_id = found.run_id
    try:
        node = create_dht(reader, record_validators=progress_validators(cfg.run.run_id))
    except SwarmError as e:
        raise fail(str(e), EXIT_RUNTIME) from None
    try:
        records = live_records(node, cfg.run.run_id)
    finally:
        node.shutdown()
    summary = summarize(cfg.run.run_id, records)
    typer.echo(json.dumps(summary) if as_json else render(summary))


@app.command()
def keygen(
    path: Annotated[Path, typer.Argument(metavar="FILE", help="Where to write the key (never overwritten).")],
) -> None:
    """Make a swarm key. Give the file to every peer, bootstrap node and status reader of the swarm
    (swarm.key_file, or --key-file): only holders can join it."""
    from p2ptrain.membership import generate_swarm_key

    if path.exists():  # a swarm's key, perhaps: replacing it would lock its holder out of the swarm
        raise fail(f"{path} already exists; a swarm key is never overwritten", EXIT_USAGE)
    try:
        generate_swarm_key(path)
    except SwarmError as e:
        raise fail(str(e), EXIT_RUNTIME) from None
    typer.echo(f"Swarm key written to {path}. Share it only with the swarm's peers (--key-file {path}).")


@app.command()
def demo(
    peers: Annotated[int, typer.Option(min=1, max=16, help="Peer processes to start.")] = 3,
    rounds: Annotated[int | None, typer.Option(min=1, help="Outer rounds (default: the config's).")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    workdir: Annotated[Path, typer.Option(help="Where peers write logs and models.")] = Path("runs/demo"),
    summary_json: Annotated[Path | None, typer.Option(help="Write the summary here as JSON.")] = None,
) -> None:
    """Start a local swarm of real peers on 127.0.0.1, train, evaluate, and print a summary."""
    cfg = resolve(config, set_, {"outer": dict(num_rounds=rounds)})
    from p2ptrain.demo import DemoError, run_demo

    writable(summary_json, "--summary-json")  # now, not after the whole demo has run
    output_folder(workdir, "--workdir")
    try:
        summary = run_demo(cfg, peers=peers, workdir=workdir, config_path=config, sets=set_ or [])
    except DemoError as e:
        raise fail(str(e), EXIT_RUNTIME) from None
    if summary_json is not None:
        summary_json.parent.mkdir(parents=True, exist_ok=True)
        summary_json.write_text(json.dumps(summary, indent=2) + "\n")
        typer.echo(f"Summary written to {summary_json}")
    if not summary["ok"]:
        raise typer.Exit(EXIT_RUNTIME)


@app.command("eval")
def eval_(
    checkpoint_paths: Annotated[
        list[Path], typer.Argument(metavar="CHECKPOINT...", help="Model files from join or demo.")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object per file.")] = False,
    plot: Annotated[
        Path | None,
        typer.Option(help="Write a PNG of validation loss against round, one line per peer."),
    ] = None,
    data_path: DataPathOpt = None,
) -> None:
    """Report validation loss, perplexity and next-token accuracy of model files; for an image classifier,
    validation loss and accuracy and test accuracy."""
    from p2ptrain.checkpoint import CheckpointError
    from p2ptrain.evaluation import Evaluator

    writable(plot, "--plot")
    for path in checkpoint_paths:
        if is_folder(path):
            raise fail(
                f"{path}: is a folder; give model files (e.g. {path / 'final.safetensors'})", EXIT_USAGE
            )
    series: dict[str, list[tuple[int, float]]] = {}
    evaluator = Evaluator()
    for path in checkpoint_paths:
        try:
            loaded, metrics = evaluator.file(path, data_path)
        except (CheckpointError, OSError) as e:
            raise fail(str(e), EXIT_RUNTIME) from None
        except ValueError as e:  # its data here (data.path: missing, too small) cannot be evaluated on
            raise fail(f"{path}: {str(e).splitlines()[0]}", EXIT_RUNTIME) from None
        cfg = loaded.config
        result = {"checkpoint": str(path), "round": loaded.round, "run_id": cfg.run.run_id, **metrics}
        peer = loaded.metadata.get("peer_id", "")[-8:] or path.resolve().parent.name or path.stem
        series.setdefault(peer, []).append((loaded.round, metrics["val_loss"]))
        if as_json:
            typer.echo(json.dumps(result))
        elif "test_accuracy" in metrics:
            typer.echo(
                f"{path}: round {loaded.round}, val_loss {metrics['val_loss']:.4f}, val accuracy "
                f"{metrics['accuracy']:.3f} ({metrics['images']} images), test accuracy "
                f"{metrics['test_accuracy']:.4f} ({metrics['test_images']} images)"
            )
        else:
            typer.echo(
                f"{path}: round {loaded.round}, val_loss {metrics['val_loss']:.4f}, "
                f"perplexity {metrics['perplexity']:.2f}, accuracy {metrics['accuracy']:.3f} "
                f"({metrics['tokens']} tokens)"
            )
    if plot is not None:
        from p2ptrain.plots import plot_loss

        try:
            plot_loss(series, plot, title="validation loss by round")
        except OSError as e:
            raise fail(f"--plot {plot}: cannot write it ({e.strerror or e})", EXIT_RUNTIME) from None
        typer.echo(f"Plot written to {plot}", err=as_json)


@app.command("export")
def export_(
    checkpoint_path: Annotated[
        Path, typer.Argument(metavar="CHECKPOINT", help="A model file from join or demo.")
    ],
    out: Annotated[
        Path, typer.Option(help="The folder to write (config.json, model.safetensors, tokenizer).")
    ],
    data_path: DataPathOpt = None,
) -> None:
    """Write a Llama-shaped model file as a Hugging Face folder: `AutoModelForCausalLM.from_pretrained(OUT)`
    opens it, and `AutoTokenizer` too where the run trained on a prepared BPE corpus (docs/data.md)."""
    from p2ptrain.checkpoint import CheckpointError
    from p2ptrain.export import ExportError, export

    if is_folder(checkpoint_path):
        raise fail(
            f"{checkpoint_path}: is a folder; give a model file (e.g. {checkpoint_path / 'final.safetensors'})",
            EXIT_USAGE,
        )
    if is_file(out):  # made by export, once the file is checked
        raise fail(f"--out {out}: is a file, not a folder", EXIT_USAGE)
    try:
        config = export(checkpoint_path, out, data_path)
    except (CheckpointError, ExportError, OSError) as e:
        raise fail(str(e), EXIT_RUNTIME if isinstance(e, CheckpointError | OSError) else EXIT_USAGE) from None
    typer.echo(
        f"{out}: LlamaForCausalLM, {config['num_hidden_layers']} layers x {config['hidden_size']}, "
        f"{config['vocab_size']} ids, round {config['p2ptrain']['round']}"
        + (", with its tokenizer" if (out / "tokenizer.json").exists() else ", byte ids (no tokenizer)")
    )


data_app = typer.Typer(no_args_is_help=True, help="Prepare corpora: tokenize once into memory-mapped shards.")
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def data_prepare(
    sources: Annotated[
        list[str],
        typer.Argument(
            metavar="SOURCE...",
            help="Text files, folders, globs ('corpus/**/*.txt'), .jsonl or .parquet files, or Hugging Face datasets "
            "saved on disk (their folders).",
        ),
    ],
    out: Annotated[Path, typer.Option(help="The folder to write (its manifest and shards are replaced).")],
    tokenizer: Annotated[
        str,
        typer.Option(
            help="'byte' (256 ids, no file), 'bpe' (trained here on the sources) or a tokenizer.json."
        ),
    ] = "byte",
    vocab_size: Annotated[int, typer.Option(help="Ids of the BPE trained with --tokenizer bpe.")] = 8192,
    text_field: Annotated[
        str,
        typer.Option(
            help="The field of a .jsonl line, or the column of a .parquet file or dataset, with the text."
        ),
    ] = "text",
    split: Annotated[str, typer.Option(help="The split of a saved Hugging Face DatasetDict.")] = "train",
    shard_tokens: Annotated[int, typer.Option(help="Tokens per shard file.")] = DEFAULT_SHARD_TOKENS,
) -> None:
    """Tokenize SOURCE... into --out: a manifest and memory-mapped token shards that `data.source: prepared`
    trains on (docs/data.md)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    from p2ptrain.prepare import PrepareError, expand_sources, prepare

    if is_file(out):
        raise fail(f"--out {out}: is a file, not a folder", EXIT_USAGE)
    try:
        found = expand_sources(sources, split, out)  # before the output folder is made: a refusal leaves none
    except (PrepareError, OSError) as e:
        raise fail(str(e), EXIT_USAGE) from None
    output_folder(out, "--out")
    try:
        total = sum(s.size() for s in found)
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
        with Progress(*columns, transient=True, disable=not sys.stderr.isatty()) as bar:
            task = bar.add_task(
                "tokenizing" if tokenizer != "bpe" else "training BPE, then tokenizing", total=total
            )
            manifest = prepare(
                sources,
                out,
                tokenizer=tokenizer,
                vocab_size=vocab_size,
                text_field=text_field,
                split=split,
                shard_tokens=shard_tokens,
                progress=lambda n: bar.advance(task, n),
            )
    except (PrepareError, OSError) as e:
        raise fail(str(e), EXIT_USAGE) from None
    typer.echo(
        f"{out}: {manifest.num_tokens:,} tokens ({manifest.tokenizer}, {manifest.vocab_size} ids) from "
        f"{manifest.documents:,} documents in {len(manifest.shards)} shard(s); sha256 {manifest.sha256[:16]}"
    )
    typer.echo(f"Train on it with: --set data.source=prepared --set data.path={out}")


@config_app.command("show")
def config_show(file: Annotated[Path | None, typer.Argument()] = None, set_: SetOpt = None) -> None:
    """Print the resolved config (file + P2PTRAIN_ env + --set) as YAML."""
    typer.echo(resolve(file, set_, {}).to_yaml(), nl=False)


@config_app.command("validate")
def config_validate(file: Annotated[Path, typer.Argument()], set_: SetOpt = None) -> None:
    """Check a config file (with P2PTRAIN_ env and --set, as join would take it); exit 2 with the field path
    of every problem."""
    resolve(file, set_, {})
    typer.echo(f"ok: {file}")


@config_app.command("reference")
def config_reference() -> None:
    """Print the config reference (docs/config.md) generated from the field docs."""
    typer.echo(reference_markdown())


def _usage_errors() -> tuple[type[Exception], ...]:
    """click's usage errors: recent typer releases vendor click (their base is typer.TyperException), older
    ones use click's own."""
    kinds: list[type[Exception]] = []
    if (vendored := getattr(typer, "TyperException", None)) is not None:
        kinds.append(vendored)
    try:
        import click

        kinds.append(click.ClickException)
    except ImportError:
        pass
    return tuple(kinds)


def main() -> None:
    try:
        code = app(standalone_mode=False)
    except _usage_errors() as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # a command without its arguments: its help is printed
            raise SystemExit(getattr(e, "exit_code", EXIT_USAGE)) from None
        # A bad flag or argument is one line, as every other error here, not a box of usage and help.
        ctx = getattr(e, "ctx", None)
        where = f"`{ctx.command_path} --help`" if ctx is not None else "`p2ptrain --help`"
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        sys.stderr.write(f"error: {message} (see {where})\n")
        raise SystemExit(getattr(e, "exit_code", EXIT_USAGE)) from None
    except typer.Abort:
        sys.stderr.write("error: aborted\n")
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    raise SystemExit(code if isinstance(code, int) else 0)
