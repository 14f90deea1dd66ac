"""Logging (p2ptrain/logs.py): one handler for structlog's lines and hivemind's."""

import logging

import pytest

from p2ptrain import logs


@pytest.fixture
def restore_logging():
    root, hivemind = logging.getLogger(), logging.getLogger("hivemind")
    handlers, root_level, hivemind_level = root.handlers[:], root.level, hivemind.level
    yield
    root.handlers[:] = handlers
    root.setLevel(root_level)
    hivemind.setLevel(hivemind_level)


def test_the_level_asked_for_quiets_hivemind_too(restore_logging, capsys):
    # `status` and the experiment reader ask for errors only: hivemind's warnings went to stderr regardless.
    logs.configure("error", "json")
    logging.getLogger("hivemind.dht.node").warning("a hivemind warning")
    logs.get_logger("p2ptrain.test").warning("a p2ptrain warning")
    assert capsys.readouterr().err == ""
    logs.configure("info", "json")
    logging.getLogger("hivemind.dht.node").info("a hivemind info line")  # noise at info: still dropped
    logging.getLogger("hivemind.dht.node").warning("a hivemind warning")
    err = capsys.readouterr().err
    assert "a hivemind warning" in err and "info line" not in err
