"""The command line: clear one-line errors with exit code 2 for bad input, and eval of a model file."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch

from p2ptrain import checkpoint
from p2ptrain.config import ExperimentConfig, deep_merge
from p2ptrain.data import Corpus, load_corpus
from p2ptrain.diloco import DiLoCo
from p2ptrain.evaluation import evaluate
from p2ptrain.models import build_model


def run(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "p2ptrain", *args], capture_output=True, text=True, timeout=timeout
    )


def one_line_error(out):
    lines = [line for line in out.stderr.strip().splitlines() if line]
    assert "Traceback" not in out.stderr
    return lines


def test_malformed_multiaddr_exits_2_with_reason():
    out = run("join", "--initial-peers", "127.0.0.1:31337")
    assert out.returncode == 2
    lines = one_line_error(out)
    assert len(lines) == 1 and "swarm.initial_peers" in lines[0] and "127.0.0.1:31337" in lines[0]


def test_malformed_config_exits_2_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("inner:\n  lr: fast\n")
    out = run("join", "--config", str(bad))
    assert out.returncode == 2
    assert one_line_error(out) == [
        f"error: {bad}: inner.lr: Input should be a valid number, unable to parse string as a number (got 'fast')"
    ]


def test_config_validate_and_show(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("outer:\n  num_rounds: 2\n")
    assert run("config", "validate", str(good)).returncode == 0
    out = run("config", "show", str(good), "--set", "inner.lr=0.01")
    assert out.returncode == 0 and "num_rounds: 2" in out.stdout and "lr: 0.01" in out.stdout
    bad = run("config", "validate", str(tmp_path / "missing.yaml"))
    assert bad.returncode == 2 and "cannot read config file" in bad.stderr
    no_key = run("config", "validate", str(good), "--set", f"swarm.key_file={tmp_path / 'swarm.key'}")
    assert no_key.returncode == 2 and one_line_error(no_key) == [
        f"error: command line: swarm.key_file {tmp_path / 'swarm.key'}: cannot read it (No such file or directory)"
    ]


def test_unknown_set_key_exits_2():
    out = run("config", "show", "--set", "inner.speed=3")
    assert out.returncode == 2 and "inner.speed: unknown key" in out.stderr


def test_eval_reports_loss_perplexity_accuracy(tmp_path):
    cfg = ExperimentConfig()
    cfg.model.name, cfg.model.context_length, cfg.data.eval_batches = "gpt-nano", 16, 2
    model = build_model("gpt-nano", 16)
    path = tmp_path / "final.safetensors"
    checkpoint.save(path, model, DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True), cfg)
    out = run("eval", str(path), "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    corpus = Corpus.from_bytes(load_corpus(cfg.data), 16, cfg.data.val_fraction)
    expected = evaluate(model, corpus, cfg, torch.device("cpu"))
    assert result["val_loss"] == pytest.approx(expected["val_loss"], rel=1e-5)
    assert result["perplexity"] == pytest.approx(math.exp(expected["val_loss"]), rel=1e-5)
    assert result["accuracy"] == pytest.approx(expected["accuracy"]) and result["round"] == 0


def test_eval_of_a_bad_file_is_a_clear_error(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_text("not a model")
    out = run("eval", str(path))
    assert out.returncode == 1 and one_line_error(out)[0].startswith("error: ")


def test_eval_takes_a_copy_of_the_runs_data_from_data_path_and_refuses_other_data(tmp_path):
    corpus = tmp_path / "there" / "corpus.txt"
    corpus.parent.mkdir()
    corpus.write_text("the run's own words, many times over\n" * 300)
    cfg = ExperimentConfig(
        model={"name": "gpt-nano", "context_length": 16},
        data={"source": "text", "path": corpus, "eval_batches": 2},
    )
    model = build_model("gpt-nano", 16)
    path = tmp_path / "final.safetensors"
    checkpoint.save(path, model, DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True), cfg)
    here = tmp_path / "copy.txt"
    here.write_bytes(corpus.read_bytes())
    expected = run("eval", str(path), "--json")
    assert expected.returncode == 0, expected.stderr
    corpus.unlink()  # another machine: the file's path is not there
    gone = run("eval", str(path))
    assert gone.returncode == 1 and len(one_line_error(gone)) == 1, gone.stderr
    assert "give your copy of it with --data-path" in gone.stderr
    copied = run("eval", str(path), "--json", "--data-path", str(here))
    assert copied.returncode == 0, copied.stderr
    assert json.loads(copied.stdout)["val_loss"] == json.loads(expected.stdout)["val_loss"]
    here.write_text("other words altogether, as many times\n" * 300)
    other = run("eval", str(path), "--data-path", str(here))
    assert other.returncode == 1 and one_line_error(other) == [
        f"error: {path}: the data at {here} is not what its run trained on (its content differs)"
    ]


def test_eval_of_a_model_whose_data_is_not_here_is_one_line(tmp_path):
    empty = tmp_path / "mnist"
    empty.mkdir()
    cfg = ExperimentConfig(
        model={"name": "cnn-tiny"}, data={"source": "idx", "path": empty}
    )  # no IDX files in it
    model = build_model("cnn-tiny", 28, num_classes=10, channels=1, image_size=(28, 28))
    path = tmp_path / "final.safetensors"
    checkpoint.save(path, model, DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True), cfg)
    out = run("eval", str(path))
    assert out.returncode == 1 and len(one_line_error(out)) == 1, out.stderr
    assert one_line_error(out)[0].startswith(f"error: {path}: data.path: {empty} has no train-images"), (
        out.stderr
    )


@pytest.mark.parametrize("outcome", ["stranded", "diverged"])
def test_a_peer_that_ends_without_the_swarms_final_model_exits_3_with_one_line(
    monkeypatch, tmp_path, outcome
):
    """The exit status follows the trainer's outcome (the outcomes themselves: tests/test_rounds.py)."""
    from typer.testing import CliRunner

    from p2ptrain import cli, trainer

    class Ends:
        def __init__(self, cfg, **_):
            pass

        def run(self):
            reason = f"this peer is {outcome}"
            return trainer.RunResult(trainer.Outcome(outcome), tmp_path / "x.safetensors", reason)

    monkeypatch.setattr(trainer, "Trainer", Ends)
    monkeypatch.setattr("p2ptrain.logs.configure", lambda *a, **k: None)
    monkeypatch.setattr(cli, "install_stop_handlers", lambda stop: None)
    result = CliRunner().invoke(cli.app, ["join", "--set", f"checkpoint.dir={tmp_path}"])
    assert result.exit_code == 3
    assert result.output.strip().splitlines()[-1] == f"error: this peer is {outcome}"


def test_an_unwritable_maddrs_file_is_one_line_before_any_dht_starts(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = run("dht", "--maddrs-file", str(blocker / "dht.maddrs"), "--host-maddrs", "/ip4/127.0.0.1/tcp/0")
    assert out.returncode == 1
    assert one_line_error(out) == [
        f"error: --maddrs-file {blocker / 'dht.maddrs'}: cannot write it ({blocker} is not a directory)"
    ]


def test_an_initial_peers_file_that_cannot_be_read_is_one_line_at_once(tmp_path):
    from p2ptrain.addrs import SwarmError, read_maddrs_file

    binary = tmp_path / "peers.bin"
    binary.write_bytes(b"\xff\xfe garbage")
    for path, says in [(tmp_path, "Is a directory"), (binary, "not UTF-8 text (byte 0)")]:
        with pytest.raises(
            SwarmError, match=rf"^swarm.initial_peers_file {path}: cannot read it \({re.escape(says)}"
        ):
            read_maddrs_file(path, timeout_s=600)  # refused at once, not waited on for 10 minutes


def test_a_volunteers_file_of_its_own_sections_joins_the_swarms_experiment(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from p2ptrain import cli
    from tests.conftest import ROOT

    assert cli.own_settings_only(ROOT / "deploy" / "experiment.example.yaml")
    assert not cli.own_settings_only(ROOT / "configs" / "tiny.yaml")
    # A training section's own fields (a slow link's timeouts) are the volunteer's too; a shared one is not.
    timeouts = tmp_path / "timeouts.yaml"
    timeouts.write_text("averaging: {barrier_timeout_s: 90}\nverification: {reveal_timeout_s: 60}\n")
    assert cli.own_settings_only(timeouts)
    for shared in (
        "averaging: {barrier_timeout_s: 90, compression: none}",
        "inner: {lr: 0.1}",
        "run: {seed: 1}",
    ):
        (tmp_path / "shared.yaml").write_text(shared + "\n")
        assert not cli.own_settings_only(tmp_path / "shared.yaml"), shared
    asked = []

    def swarm_experiment(overrides, own, path):
        asked.append(deep_merge(own, overrides))  # the file's layer under the flags (the environment between)
        raise cli.typer.Exit(0)

    monkeypatch.setattr(cli, "swarm_experiment", swarm_experiment)
    volunteer = tmp_path / "volunteer.yaml"
    volunteer.write_text("run: {run_id: their-run}\ndevice: {num_threads: 2}\n")
    result = CliRunner().invoke(
        cli.app, ["join", "--config", str(volunteer), "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/x"]
    )
    assert result.exit_code == 0, result.output
    assert asked[-1]["run"] == {"run_id": "their-run"} and asked[-1]["device"] == {"num_threads": 2}
    assert asked[-1]["swarm"]["initial_peers"] == ["/ip4/1.2.3.4/tcp/1/p2p/x"]
    result = CliRunner().invoke(
        cli.app, ["join", "--config", str(timeouts), "--initial-peers", "/ip4/1.2.3.4/tcp/1/p2p/x"]
    )
    assert result.exit_code == 0, result.output
    assert asked[-1]["averaging"] == {"barrier_timeout_s": 90}


def test_the_join_line_a_peer_or_a_bootstrap_node_prints_is_complete(tmp_path):
    # Copied as printed, it joins: a closed swarm's key, the run a bootstrap node was told to watch, and the
    # joiner's own copy of a text corpus are on it.
    from p2ptrain import cli

    maddr = "/ip4/203.0.113.5/tcp/31337/p2p/12D3KooWexample"
    key, corpus = tmp_path / "swarm.key", tmp_path / "corpus.txt"
    key.write_text("ab" * 32 + "\n")
    corpus.write_text("some text of ours\n" * 400)
    plain = cli.resolve(None, None, {})
    assert cli.join_line(maddr, plain, run_id="run_id" in plain.run.model_fields_set) == (
        f"p2ptrain join --initial-peers {maddr}"
    )
    closed = cli.resolve(None, None, {"run": {"run_id": "my-run"}, "swarm": {"key_file": key}})
    assert cli.join_line(maddr, closed, run_id="run_id" in closed.run.model_fields_set) == (
        f"p2ptrain join --initial-peers {maddr} --key-file {key} --run-id my-run"
    )
    text = cli.resolve(None, ["data.source=text", f"data.path={corpus}"], {})
    assert cli.join_line(maddr, text, run_id=False) == (
        f"p2ptrain join --initial-peers {maddr} --set data.path=<your copy of corpus.txt>"
    )


def test_data_prepare_writes_a_folder_a_config_trains_on_and_bad_sources_are_one_line(tmp_path):
    (tmp_path / "a.txt").write_text("hello prepared world\n" * 200)
    out = run("data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "data"))
    assert out.returncode == 0, out.stderr
    assert "4,201 tokens (byte, 256 ids) from 1 documents" in out.stdout
    assert f"--set data.source=prepared --set data.path={tmp_path / 'data'}" in out.stdout
    shown = run("config", "show", "--set", "data.source=prepared", "--set", f"data.path={tmp_path / 'data'}")
    assert shown.returncode == 0 and "source: prepared" in shown.stdout
    bad = run("data", "prepare", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x"))
    assert bad.returncode == 2 and one_line_error(bad) == [
        f"error: source {tmp_path / 'missing.txt'}: no such file or folder"
    ]
    unprepared = run("config", "show", "--set", "data.source=prepared", "--set", f"data.path={tmp_path}")
    assert unprepared.returncode == 2
    assert len(one_line_error(unprepared)) == 1 and "no manifest.json" in unprepared.stderr


def test_a_joiners_own_bad_flags_are_refused_before_it_asks_the_swarm():
    # Without --config the joiner takes the swarm's experiment; its own flags are checked first, so a typo
    # is one line at once, not an unreachable swarm (nobody listens here) or a DHT started for nothing.
    nobody = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWGPqLr56TyMWzcrRrD7qKoFtiSXvqtQdMqXhirUxDGfgh"
    out = run("join", "--initial-peers", nobody, "--device", "tpu", "--set", "inner.lr=abc")
    assert out.returncode == 2
    lines = one_line_error(out)
    assert len(lines) == 2 and {line.split(":")[2].strip() for line in lines} == {
        "device.kind",
        "inner.lr",
    }, lines
    assert not any("swarm" in line for line in lines), lines


def test_output_paths_are_refused_before_the_work_that_ends_in_them(tmp_path):
    folder, file = tmp_path / "folder", tmp_path / "file.yaml"
    folder.mkdir()
    file.write_text("mine\n")
    cases = [
        (
            ("eval", str(tmp_path / "model.safetensors"), "--plot", str(folder)),
            f"--plot {folder}: cannot write",
        ),
        (("eval", str(folder)), f"{folder}: is a folder"),
        (("export", str(folder), "--out", str(tmp_path / "hf")), f"{folder}: is a folder"),
        (("join", "--rounds", "abc"), "Invalid value for '--rounds'"),  # click's usage errors: one line too
        (("join", "--no-such-flag"), "No such option: --no-such-flag (see `"),
        (("eval",), "Missing argument"),
        (("demo", "--peers", "1", "--workdir", str(file)), f"--workdir {file}: is a file"),
        (("demo", "--peers", "1", "--summary-json", str(folder)), f"--summary-json {folder}: cannot write"),
        (("export", str(tmp_path / "model.safetensors"), "--out", str(file)), f"--out {file}: is a file"),
        (("data", "prepare", str(file), "--out", str(file)), f"--out {file}: is a file"),
    ]
    for args, expected in cases:
        out = run(*args)
        assert out.returncode == 2, (args, out.stderr)
        assert len(one_line_error(out)) == 1, (args, out.stderr)
        assert one_line_error(out)[0].startswith(f"error: {expected}"), (args, out.stderr)
    assert file.read_text() == "mine\n"


def test_a_demo_clears_only_its_own_earlier_files(tmp_path):
    from p2ptrain.demo import clear_earlier_demo

    (tmp_path / "peer0").mkdir()
    (tmp_path / "peer0" / "final.safetensors").write_text("x")
    (tmp_path / "peer12.log").write_text("x")
    mine = [tmp_path / "peers.txt", tmp_path / "peer-review.md", tmp_path / "peer3.log.bak"]
    for path in mine:
        path.write_text("a user's own")
    clear_earlier_demo(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in mine)


def test_hiveminds_errors_reach_the_user_without_p2pds_timestamp_or_advice_for_hivemind_callers():
    from p2ptrain.swarm import _reason

    raw = "P2PDaemonError('Daemon failed to start: 2026/12/05 17:05:07 invalid p2p multiaddr')"
    assert _reason(Exception(raw)) == "P2PDaemonError('Daemon failed to start: invalid p2p multiaddr')"
    said = (
        "Traceback ...\nRuntimeError: none of the initial_peers responded to a ping. "
        "(set ensure_bootstrap_success=False to ignore)"
    )
    assert _reason(Exception(said)) == "RuntimeError: none of the initial_peers responded to a ping."
    assert _reason(TimeoutError()) == "TimeoutError"


def test_status_watches_the_swarms_only_run_unless_told_which(monkeypatch):
    """After the README's tiny.yaml example (run p2ptrain-tiny), `status --initial-peers ...` as printed showed
    0 peers: it watched run.run_id's default. It takes the swarm's only published run, as a joiner does."""
    import types

    from typer.testing import CliRunner

    from p2ptrain import cli, swarm

    published, watched = [], []

    def only_run(reader, run_id):
        published.append(run_id)
        return types.SimpleNamespace(run_id="p2ptrain-tiny")

    monkeypatch.setattr(cli, "_published_experiment", only_run)
    monkeypatch.setattr(swarm, "create_dht", lambda *a, **k: types.SimpleNamespace(shutdown=lambda: None))
    monkeypatch.setattr(swarm, "live_records", lambda node, run_id: watched.append(run_id) or {})
    peer = "/ip4/127.0.0.1/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    result = CliRunner().invoke(cli.app, ["status", "--initial-peers", peer, "--json"])
    assert result.exit_code == 0, result.output
    assert published == [None] and watched == ["p2ptrain-tiny"]
    assert json.loads(result.output.strip().splitlines()[-1])["run_id"] == "p2ptrain-tiny"
    result = CliRunner().invoke(cli.app, ["status", "--initial-peers", peer, "--run-id", "mine", "--json"])
    assert result.exit_code == 0, result.output
    assert published == [None] and watched[-1] == "mine", "a run named is the run watched"
