"""The ``p2ptrain`` command.

Exit codes: 0 success (also after a clean stop on SIGINT/SIGTERM), 1 runtime failure (swarm
unreachable, a bad model file), 2 usage or config error. Errors are one line on stderr, no traceback.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer

from p2ptrain.config import ConfigError, deep_merge, load_config, parse_set, reference_markdown

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Train one model together on machines you already own: peer-to-peer DiLoCo over a hivemind DHT.",
)
config_app = typer.Typer(no_args_is_help=True, help="Inspect and check experiment configs.")
app.add_typer(config_app, name="config")

EXIT_RUNTIME, EXIT_USAGE = 1, 2

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
    client_mode: bool | None = None,
) -> dict[str, Any]:
    """The swarm section's command-line flags as config overrides (None: not given)."""
    return dict(
        initial_peers=_split(initial_peers),
        host_maddrs=_split(host_maddrs),
        announce_maddrs=_split(announce_maddrs),
        identity_path=identity_path,
        client_mode=client_mode,
    )


def resolve(config: Path | None, sets: list[str] | None, flags: dict[str, dict[str, Any]]) -> Any:
    """Config from file + env + flags; ConfigError becomes exit 2 with the field path."""
    try:
        overrides = deep_merge(parse_set(sets or []), {})
        for section, values in flags.items():
            values = {k: v for k, v in values.items() if v is not None}
            if values:
                overrides = deep_merge(overrides, {section: values})
        return load_config(config, overrides)
    except ConfigError as e:
        raise fail(str(e).replace("\n", "\nerror: "), EXIT_USAGE) from None


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


@app.command()
def join(
    config: ConfigOpt = None,
    initial_peers: MaddrsOpt = None,
    host_maddrs: MaddrsOpt = None,
    announce_maddrs: MaddrsOpt = None,
    identity_path: Annotated[Path | None, typer.Option(help="Private key file: a stable peer id.")] = None,
    client_mode: Annotated[bool | None, typer.Option(help="Accept no incoming connections.")] = None,
    device: Annotated[str | None, typer.Option(help="auto | cpu | cuda | mps.")] = None,
    rounds: Annotated[int | None, typer.Option(help="outer.num_rounds.")] = None,
    set_: SetOpt = None,
    log_level: LogLevelOpt = None,
    log_format: LogFormatOpt = None,
) -> None:
    """Train with the swarm. Without --initial-peers, start a new swarm and print the address others join."""
    cfg = resolve(
        config,
        set_,
        {
            "swarm": swarm_flags(initial_peers, host_maddrs, announce_maddrs, identity_path, client_mode),
            "device": dict(kind=device),
            "outer": dict(num_rounds=rounds),
            "log": dict(level=log_level, format=log_format),
        },
    )
    from p2ptrain import logs

    logs.configure(cfg.log.level, cfg.log.format, run_id=cfg.run.run_id)
    from p2ptrain.swarm import SwarmError
    from p2ptrain.trainer import Trainer

    stop = threading.Event()
    install_stop_handlers(stop)
    logs.get_logger("p2ptrain.cli").info("config", **cfg.model_dump(mode="json"))

    def announce(maddrs: list[str]) -> None:
        if not cfg.swarm.initial_peers:
            typer.echo("Started a new swarm. Others join it with:")
        else:
            typer.echo("Joined the swarm. Others can also join through this peer:")
        for maddr in maddrs:
            typer.echo(f"  p2ptrain join --initial-peers {maddr}")
        sys.stdout.flush()

    trainer = Trainer(cfg, stop=stop, on_started=announce)
    try:
        final = trainer.run()
    except SwarmError as e:
        raise fail(str(e), EXIT_RUNTIME) from None
    except ValueError as e:  # user-facing problems found at setup (device not available, corpus too small)
        raise fail(str(e), EXIT_USAGE) from None
    if final is not None:
        typer.echo(f"Final model: {final}")


@app.command()
def dht(
    initial_peers: MaddrsOpt = None,
    host_maddrs: MaddrsOpt = None,
    announce_maddrs: MaddrsOpt = None,
    identity_path: Annotated[Path | None, typer.Option(help="Private key file: a stable peer id.")] = None,
    set_: SetOpt = None,
    log_level: LogLevelOpt = None,
    log_format: LogFormatOpt = None,
) -> None:
    """Run a long-lived bootstrap node that does not train. Peers pass its address as --initial-peers."""
    cfg = resolve(
        None,
        set_,
        {
            "swarm": swarm_flags(initial_peers, host_maddrs, announce_maddrs, identity_path),
            "log": dict(level=log_level, format=log_format),
        },
    )
    from p2ptrain import logs
    from p2ptrain.swarm import SwarmError, create_dht

    logs.configure(cfg.log.level, cfg.log.format)
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        node = create_dht(cfg.swarm)
    except SwarmError as e:
        raise fail(str(e), EXIT_RUNTIME) from None
    try:
        typer.echo("DHT node running. Peers join with:")
        for maddr in node.get_visible_maddrs():
            typer.echo(f"  p2ptrain join --initial-peers {maddr}")
        sys.stdout.flush()
        while not stop.wait(1.0):
            if not node.is_alive():
                raise fail("the DHT process died", EXIT_RUNTIME)
    finally:
        if node.is_alive():
            node.shutdown()


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
    checkpoint_path: Annotated[
        Path, typer.Argument(metavar="CHECKPOINT", help="A model file from join or demo.")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Report validation loss, perplexity and next-byte accuracy of a model file."""
    from p2ptrain.checkpoint import CheckpointError
    from p2ptrain.checkpoint import load as load_checkpoint
    from p2ptrain.data import Corpus, load_corpus
    from p2ptrain.models import build_model
    from p2ptrain.trainer import evaluate

    try:
        loaded = load_checkpoint(checkpoint_path)
        cfg = loaded.config
        model = build_model(cfg.model.name, cfg.model.context_length)
        from p2ptrain.checkpoint import load_into

        load_into(model, loaded, checkpoint_path)
        corpus = Corpus.from_bytes(load_corpus(cfg.data), cfg.model.context_length, cfg.data.val_fraction)
    except (CheckpointError, OSError) as e:
        raise fail(str(e), EXIT_RUNTIME) from None
    import torch

    metrics = evaluate(model, corpus, cfg, torch.device("cpu"))
    result = {"checkpoint": str(checkpoint_path), "round": loaded.round, "run_id": cfg.run.run_id, **metrics}
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(
            f"{checkpoint_path}: round {loaded.round}, val_loss {metrics['val_loss']:.4f}, "
            f"perplexity {metrics['perplexity']:.2f}, accuracy {metrics['accuracy']:.3f} "
            f"({metrics['tokens']} tokens)"
        )


@config_app.command("show")
def config_show(file: Annotated[Path | None, typer.Argument()] = None, set_: SetOpt = None) -> None:
    """Print the resolved config (file + P2PTRAIN_ env + --set) as YAML."""
    typer.echo(resolve(file, set_, {}).to_yaml(), nl=False)


@config_app.command("validate")
def config_validate(file: Annotated[Path, typer.Argument()]) -> None:
    """Check a config file; exit 2 with the field path of every problem."""
    resolve(file, None, {})
    typer.echo(f"ok: {file}")


@config_app.command("reference")
def config_reference() -> None:
    """Print the config reference (docs/config.md) generated from the field docs."""
    typer.echo(reference_markdown())


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        raise SystemExit(130) from None
