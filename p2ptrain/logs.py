"""Logging: structlog on top of the standard library, hivemind's records through the same handler.

JSON lines when stderr is not a terminal (a service, a pipe, the demo's peers), readable console
lines on a terminal. Call :func:`configure` once, before the DHT forks.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

# Context bound to every line of this process, from any thread (hivemind's threads and the heartbeat
# included): contextvars would not reach threads started before the value was bound.
_BOUND: dict[str, Any] = {}

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


def configure(level: str = "info", fmt: str = "auto", **bound: Any) -> None:
    """Route structlog and stdlib logging (hivemind's included) to stderr.

    Args:
        level: debug | info | warning | error (hivemind's lines: at warning unless debug, error if error).
        fmt: auto | json | console.
        bound: context bound to every line (run_id, peer_id, ...).
    """
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    shared: list[Any] = [
        _add_bound,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (
        structlog.processors.JSONRenderer()
        if fmt == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    handler = logging.StreamHandler(_CurrentStderr())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_LEVELS[level])

    # hivemind installs its own handler on its loggers; hand its records to ours instead.
    from hivemind.utils.logging import use_hivemind_log_handler

    use_hivemind_log_handler("nowhere")
    # Its info lines are noise to us: at warning unless debug, and never below what was asked (error: quiet).
    logging.getLogger("hivemind").setLevel(
        logging.DEBUG if level == "debug" else max(logging.WARNING, _LEVELS[level])
    )

    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    _BOUND.clear()
    _BOUND.update(bound)


class _CurrentStderr:
    """Whatever sys.stderr is at the time of writing, so that a progress bar that redirects it keeps log
    lines above itself instead of tearing through it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _add_bound(_logger: Any, _method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    for key, value in _BOUND.items():
        event_dict.setdefault(key, value)  # a value passed to the call itself wins
    return event_dict


def bind(**values: Any) -> None:
    """Add context to every following line of this process (run_id, peer_id, round)."""
    _BOUND.update(values)


def unbind(*keys: str) -> None:
    for key in keys:
        _BOUND.pop(key, None)
