"""Every command in README.md's code blocks: those that run offline on one machine run as written; the others
(a second machine, a Docker daemon, minutes of training, the suite itself) are parsed by the real CLI, so a
renamed flag or a bad value in the README fails here."""

from __future__ import annotations

import glob
import os
import re
import shlex

import pytest

from p2ptrain import checkpoint
from p2ptrain.config import ConfigError, ExperimentConfig, load_config
from p2ptrain.diloco import DiLoCo
from p2ptrain.models import build_model
from tests.conftest import ROOT
from tests.test_deploy import parse_cli

# Why a command is not run as written (it is parsed instead, where it is p2ptrain's).
NOT_RUN = {
    "make": "the Makefile's targets: CI runs `make test`; `make demo` trains for minutes",
    "pip": "installs the package",
    "docker": "needs a Docker daemon",
    "p2ptrain join": "joins or starts a swarm on the network (a second machine, or UPnP on the LAN)",
    "p2ptrain dht": "a long-running bootstrap node on the network",
    "p2ptrain status": "reads a running swarm",
    "p2ptrain demo": "trains for minutes (tests/integration/test_training.py runs a short demo)",
}


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].split(" # ")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def program(command: str) -> str:
    words = [w for w in shlex.split(command) if not re.match(r"^[A-Z_][A-Z0-9_]*=", w)]
    words[0] = os.path.basename(words[0])
    return " ".join(words[:2]) if words[0] == "p2ptrain" else words[0]


def test_the_readme_has_the_commands_this_test_knows():
    programs = {program(c) for c in readme_commands()}
    assert {"make", "p2ptrain join", "p2ptrain eval", "p2ptrain config"} <= programs
    assert programs <= set(NOT_RUN) | {"p2ptrain eval", "p2ptrain config", "p2ptrain keygen"}, programs


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with the files README's commands read: configs/, a peer's final model, a demo's peers."""
    here = tmp_path_factory.mktemp("readme")
    (here / "configs").symlink_to(ROOT / "configs")
    cfg = ExperimentConfig()
    cfg.model.name, cfg.model.context_length, cfg.data.eval_batches = "gpt-nano", 16, 2
    model = build_model("gpt-nano", 16)
    diloco = DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True)
    for path in [
        "checkpoints/p2ptrain-tiny/peer-0/final.safetensors",
        "runs/demo/peer0/final.safetensors",
        "runs/demo/peer1/final.safetensors",
    ]:
        checkpoint.save(here / path, model, diloco, cfg)
    return here


@pytest.mark.parametrize("command", [c for c in readme_commands() if program(c) not in NOT_RUN])
def test_readme_command_runs_as_written(command, workdir, monkeypatch):
    # In this process (a new interpreter per command would cost seconds each), with the shell's part done
    # here: VAR=value prefixes and globs.
    from typer.testing import CliRunner

    from p2ptrain.cli import app

    monkeypatch.chdir(workdir)
    words = shlex.split(command)
    while re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        name, value = words.pop(0).split("=", 1)
        monkeypatch.setenv(name, value)
    assert words[0] == "p2ptrain"
    args = [match for word in words[1:] for match in (sorted(glob.glob(word)) if "*" in word else [word])]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"{command}\n{result.output[-3000:]}"
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


@pytest.mark.parametrize("command", [c for c in readme_commands() if program(c).startswith("p2ptrain ")])
def test_readme_p2ptrain_command_parses(command, monkeypatch):
    words = shlex.split(command)
    while re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        name, value = words.pop(0).split("=", 1)
        monkeypatch.setenv(name, value)
    args = [w for w in words[1:] if w not in ("...", "[--json]")]  # the README's placeholders
    if args[0] == "config":
        return  # runs as written above
    ctx = parse_cli(args)
    overrides = {k: v for k, v in ctx.params.items() if v is not None}
    if overrides.get("config"):
        try:
            load_config(ROOT / overrides["config"])
        except ConfigError as e:
            pytest.fail(f"{command}: {e}")
