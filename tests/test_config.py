import re
from pathlib import Path

import pytest

from p2ptrain.config import (
    ConfigError,
    ExperimentConfig,
    check_fields,
    load_config,
    parse_set,
    reference_markdown,
)
from tests.conftest import ROOT


def write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_default_config_file_spells_out_the_built_in_defaults():
    # Installed without the source tree, p2ptrain has no configs/ folder: the defaults must be the experiment.
    assert load_config(ROOT / "configs" / "default.yaml") == load_config() == ExperimentConfig()
    assert load_config().model.name == "gpt-micro" and load_config().data.source == "pydoc"


def test_every_shipped_config_validates(tmp_path):
    from tests.test_images import mnist_like

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        text = path.read_text()
        assert text.startswith("# p2ptrain "), f"{path.name} must start with the command that runs it"
        # A config of data that each user brings names it in its command (--set data.path=...): a stand-in here.
        needs_path = "--set data.path=" in text.splitlines()[0] and "source: idx" in text
        load_config(path, {"data": {"path": str(mnist_like(tmp_path / "mnist"))}} if needs_path else None)


def test_yaml_values_are_used(tmp_path):
    cfg = load_config(write(tmp_path, "inner:\n  lr: 0.01\nouter:\n  num_rounds: 3\n"))
    assert cfg.inner.lr == 0.01 and cfg.outer.num_rounds == 3
    assert cfg.inner.batch_size == ExperimentConfig().inner.batch_size  # untouched keys keep defaults


def test_unknown_key_names_its_path(tmp_path):
    with pytest.raises(ConfigError, match=r"inner\.learning_rate: unknown key"):
        load_config(write(tmp_path, "inner:\n  learning_rate: 0.1\n"))


def test_unknown_section_names_its_path(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer: unknown key"):
        load_config(write(tmp_path, "trainer:\n  lr: 0.1\n"))


def test_wrong_type_names_field_and_value(tmp_path):
    with pytest.raises(ConfigError, match=r"inner\.batch_size: .*'many'"):
        load_config(write(tmp_path, "inner:\n  batch_size: many\n"))


def test_out_of_range_value(tmp_path):
    with pytest.raises(ConfigError, match=r"inner\.lr: .*greater than 0"):
        load_config(write(tmp_path, "inner:\n  lr: -1\n"))


def test_request_timeout_must_be_below_matchmaking_time(tmp_path):
    text = "averaging:\n  request_timeout_s: 5\n  matchmaking_time_s: 3\n"
    with pytest.raises(ConfigError, match=r"c.yaml: averaging\.request_timeout_s must be smaller"):
        load_config(write(tmp_path, text))


def test_bad_multiaddr_names_field(tmp_path):
    with pytest.raises(ConfigError, match=r"swarm\.initial_peers: .*not a multiaddr"):
        load_config(write(tmp_path, "swarm:\n  initial_peers: ['localhost:1234']\n"))


def test_text_source_needs_an_existing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path is required"):
        load_config(write(tmp_path, "data:\n  source: text\n"))
    with pytest.raises(ConfigError, match=r"no such file"):
        load_config(write(tmp_path, f"data:\n  source: text\n  path: {tmp_path}/missing.txt\n"))


def test_malformed_yaml_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"not valid YAML \(line \d+, column \d+\)"):
        load_config(write(tmp_path, "inner:\n  lr: [0.1\n"))
    with pytest.raises(ConfigError, match=r"top level must be a mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))


def test_a_config_file_that_is_no_config_is_one_line_never_a_traceback_or_a_hang(tmp_path):
    cases = [
        (b"inner:\n  lr: \xff\n", r"not UTF-8 text \(byte 13\)"),
        (b"1: 2\n", r"1 is not a section's name"),
        (b"swarm: 5\n", r"section 'swarm' is int '5', not a mapping of its keys"),
        (b"inner: [0.1]\n", r"section 'inner' is list"),
        (
            b"inner: {lr: 0.1}\ninner: {lr: 0.2}\n",
            r"not valid YAML \(line 2, column 1\): key 'inner' is given twice",
        ),
        (b"inner: {lr: 0.1, lr: 0.2}\n", r"key 'lr' is given twice"),
        (b"[" * 5000, r"nested too deeply"),
        (b"x" * (1 << 20) + b"\n", r"too large for a config"),
    ]
    for text, says in cases:
        path = tmp_path / "c.yaml"
        path.write_bytes(text)
        with pytest.raises(ConfigError, match=says) as refused:
            load_config(path, {"swarm": {"min_peers": 1}})  # a flag into the same section changes nothing
        assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=r"config file /dev/zero: more than 1048576 bytes"):
        load_config(Path("/dev/zero"))  # endless: read no further than a config can be
    with pytest.raises(ConfigError, match=r"cannot read config file .*: Is a directory"):
        load_config(tmp_path)
    # What stays allowed: a byte-order mark, an empty section, YAML's merge keys and a key that overrides one.
    path.write_bytes("\ufeffinner: {<<: {lr: 0.1, batch_size: 8}, lr: 0.2}\nswarm:\n".encode())
    assert (load_config(path).inner.lr, load_config(path).inner.batch_size) == (0.2, 8)


def test_values_nested_too_deeply_or_too_large_are_one_line(monkeypatch):
    with pytest.raises(ConfigError, match=r"^--set inner.lr: the value is nested too deeply$"):
        parse_set(["inner.lr=" + "[" * 3000])
    monkeypatch.setenv("P2PTRAIN_INNER__BETAS", "[" * 3000)
    with pytest.raises(
        ConfigError, match=r"^environment variables: a P2PTRAIN_ variable's JSON is nested too"
    ):
        load_config(None)
    monkeypatch.delenv("P2PTRAIN_INNER__BETAS")
    monkeypatch.setenv("P2PTRAIN_INNER", "garbage")
    with pytest.raises(ConfigError, match=r"^environment variable P2PTRAIN_INNER: a whole section is JSON"):
        load_config(None)
    monkeypatch.setenv("P2PTRAIN_INNER", '{"lr": 0.5}')
    assert load_config(None).inner.lr == 0.5
    monkeypatch.delenv("P2PTRAIN_INNER")
    for field, value in [("inner.batch_size", 10**20), ("run.seed", 2**63), ("run.seed", -(2**63) - 1)]:
        section, key = field.split(".")
        with pytest.raises(ConfigError, match=rf"^command line: {field}: "):
            load_config(None, {section: {key: value}})
    assert load_config(None, {"run": {"seed": 2**63 - 1}}).run.seed == 2**63 - 1
    assert load_config(None, {"run": {"seed": -1}}).run.seed == -1  # as before: any int64


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read config file"):
        load_config(tmp_path / "nope.yaml")


def test_precedence_overrides_beat_env_beat_yaml(tmp_path, monkeypatch):
    path = write(tmp_path, "inner:\n  lr: 0.01\n  batch_size: 4\n  num_inner_steps: 7\n")
    monkeypatch.setenv("P2PTRAIN_INNER__LR", "0.02")
    monkeypatch.setenv("P2PTRAIN_INNER__BATCH_SIZE", "5")
    cfg = load_config(path, parse_set(["inner.lr=0.03"]))
    assert cfg.inner.lr == 0.03  # flag > env
    assert cfg.inner.batch_size == 5  # env > yaml
    assert cfg.inner.num_inner_steps == 7  # yaml > default


def test_parse_set_types_and_errors():
    assert parse_set(["outer.nesterov=false", "swarm.host_maddrs=[/ip4/127.0.0.1/tcp/0]"]) == {
        "outer": {"nesterov": False},
        "swarm": {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"]},
    }
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_set(["inner.lr"])
    with pytest.raises(ConfigError, match="must be section.key"):
        parse_set(["lr=1"])


def test_training_hash_ignores_local_sections():
    a, b = ExperimentConfig(), ExperimentConfig()
    b.device.kind = "cpu"
    b.swarm.heartbeat_s = 1.0
    assert a.training_hash() == b.training_hash()
    b.inner.lr = 0.5
    assert a.training_hash() != b.training_hash()


def test_docs_config_reference_is_current():
    doc = (ROOT / "docs" / "config.md").read_text()
    assert doc.strip() == reference_markdown().strip(), "run: p2ptrain config reference > docs/config.md"


def test_training_on_is_for_rounds_by_steps_without_replicas():
    with pytest.raises(ConfigError, match=r"inner.max_steps_while_waiting 5 is for rounds by steps"):
        load_config(None, {"inner": {"max_steps_while_waiting": 5, "round_seconds": 3.0}})
    with pytest.raises(ConfigError, match=r"inner.max_steps_while_waiting 5 with verification.replicas 2"):
        load_config(None, {"inner": {"max_steps_while_waiting": 5}, "verification": {"replicas": 2}})
    assert load_config(None, {"inner": {"max_steps_while_waiting": 5}}).inner.max_steps_while_waiting == 5


def test_linger_must_outlast_a_failed_sync():
    with pytest.raises(ConfigError, match=r"swarm.linger_s \(30.0\) must be 0 or at least .* = 270.0"):
        load_config(None, {"swarm": {"linger_s": 30}})
    assert load_config(None, {"swarm": {"linger_s": 0}}).swarm.linger_s == 0  # leaving at once is a choice
    cfg = load_config(
        None, {"swarm": {"linger_s": 100}, "averaging": {"retries": 0, "allreduce_timeout_s": 80}}
    )
    assert cfg.swarm.linger_s == 100


def test_each_bad_value_is_blamed_on_where_it_came_from(tmp_path, monkeypatch):
    path = write(tmp_path, "outer:\n  num_rounds: 2\n")
    monkeypatch.setenv("P2PTRAIN_INNER__LR", "fast")
    with pytest.raises(ConfigError, match=r"^environment variable P2PTRAIN_INNER__LR: inner.lr: "):
        load_config(path)
    monkeypatch.delenv("P2PTRAIN_INNER__LR")
    monkeypatch.setenv("P2PTRAIN_INNER__LR__X", "1")  # nested in inner.lr
    with pytest.raises(ConfigError, match=r"^environment variable P2PTRAIN_INNER__LR__X: inner.lr: "):
        load_config(path)
    monkeypatch.delenv("P2PTRAIN_INNER__LR__X")
    monkeypatch.setenv("P2PTRAIN_INNER", '{"foo": 1}')  # the section as JSON
    with pytest.raises(ConfigError, match=r"^environment variable P2PTRAIN_INNER: inner.foo: unknown key"):
        load_config(path)
    monkeypatch.delenv("P2PTRAIN_INNER")
    # A section's own check (between its fields) is the file's, not another field's variable's (the image and
    # the systemd unit set P2PTRAIN_SWARM__IDENTITY_PATH).
    monkeypatch.setenv("P2PTRAIN_SWARM__IDENTITY_PATH", str(tmp_path / "identity.key"))
    slow = tmp_path / "slow.yaml"
    slow.write_text("swarm:\n  heartbeat_s: 15\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(slow))}: swarm.record_ttl_s must be"):
        load_config(slow)
    monkeypatch.delenv("P2PTRAIN_SWARM__IDENTITY_PATH")
    with pytest.raises(ConfigError, match=r"^command line: inner.lr: "):
        load_config(path, parse_set(["inner.lr=slow"]))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: outer.num_rounds: "):
        load_config(write(tmp_path, "outer:\n  num_rounds: many\n"))


def test_a_text_corpus_that_is_a_directory_or_too_small_is_refused_at_validation(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(None, {"data": {"source": "text", "path": str(tmp_path)}})
    tiny = tmp_path / "two-bytes.txt"
    tiny.write_text("hi")
    with pytest.raises(
        ConfigError, match=r"has 2 bytes, too few for model.context_length 64 .*at least 195 bytes"
    ):
        load_config(None, {"data": {"source": "text", "path": str(tiny)}})
    tiny.write_text("x" * 195)
    assert load_config(None, {"data": {"source": "text", "path": str(tiny)}}).data.path == tiny


def test_a_text_corpus_that_is_not_utf8_is_refused_at_validation_naming_the_byte(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"x" * 300 + bytes([0xFF, 0xFE]) + b"y" * 300)
    with pytest.raises(ConfigError, match=r"data.path: .*model.bin is not UTF-8 text \(byte 300\)"):
        load_config(None, {"data": {"source": "text", "path": str(binary)}})
    binary.write_text("é" * 300)  # the same path rewritten as text: read again, not taken from a cache
    assert load_config(None, {"data": {"source": "text", "path": str(binary)}}).data.path == binary


def test_a_swarm_key_file_that_is_missing_or_not_a_key_is_refused_at_validation(tmp_path):
    with pytest.raises(
        ConfigError, match=r"^command line: swarm.key_file .*missing.key: cannot read it \(No such"
    ):
        load_config(None, {"swarm": {"key_file": str(tmp_path / "missing.key")}})
    bad = tmp_path / "bad.key"
    bad.write_text("hunter2\n")
    with pytest.raises(
        ConfigError, match=r"^command line: swarm.key_file .*bad.key: not a swarm key \(64 hexadecimal"
    ):
        load_config(None, {"swarm": {"key_file": str(bad)}})
    bad.write_text("ab" * 32 + "\n")
    assert load_config(None, {"swarm": {"key_file": str(bad)}}).swarm.key_file == bad
    bad.write_text("AB" * 32 + "\n")  # upper case: the same key
    assert load_config(None, {"swarm": {"key_file": str(bad)}}).swarm.key_file == bad


def test_metrics_listen_on_this_machine_only_unless_asked():
    assert ExperimentConfig().metrics.host == "127.0.0.1"


def test_the_package_declares_what_it_imports_and_an_spdx_license():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert isinstance(project["license"], str), (
        "a TOML table license is deprecated (a warning on every install)"
    )
    assert any(d.lower().startswith("pyyaml") for d in project["dependencies"]), "config.py imports yaml"


def test_verification_refuses_dropout_error_feedback_and_more_than_three_replicas(tmp_path):
    text = "model:\n  dropout: 0.1\nverification:\n  replicas: 2\n"
    with pytest.raises(ConfigError, match=r"verification\.replicas 2 needs model\.dropout 0"):
        load_config(write(tmp_path, text))
    text = "averaging:\n  error_feedback: true\nverification:\n  replicas: 2\n"
    with pytest.raises(ConfigError, match=r"verification\.replicas 2 needs averaging\.error_feedback false"):
        load_config(write(tmp_path, text))
    text = "inner:\n  round_seconds: 20\nverification:\n  replicas: 2\ndevice:\n  benchmark_steps: 0\n"
    with pytest.raises(
        ConfigError, match=r"inner\.round_seconds with verification\.replicas 2 needs device\.benchmark"
    ):
        load_config(write(tmp_path, text))
    assert load_config(write(tmp_path, "inner:\n  round_seconds: 20\nverification:\n  replicas: 2\n"))
    with pytest.raises(ConfigError, match=r"verification\.replicas: .*less than or equal to 3"):
        load_config(write(tmp_path, "verification:\n  replicas: 4\n"))
    assert load_config(write(tmp_path, "verification:\n  replicas: 2\n")).verification.replicas == 2


def test_no_release_changes_or_drops_a_default_of_the_training_sections():
    """What a run publishes, hashes and embeds leaves out the fields at their defaults (config.TRAINING_SECTIONS):
    a changed or dropped default would make runs of two releases train differently under one hash.
    Regenerate the file after adding a field: python -c "import json; from p2ptrain.config import *;
    print(json.dumps(without_own_fields(training_defaults()), indent=1, sort_keys=True))" """
    import json

    from p2ptrain.config import training_defaults, without_own_fields

    released = json.loads((ROOT / "tests" / "released_defaults.json").read_text())
    now = without_own_fields(training_defaults())  # each peer's own (timeouts): not in the hash
    changed = [
        f"{name}.{key}: {value!r} released, {now.get(name, {}).get(key, '(dropped)')!r} now"
        for name, fields in released.items()
        for key, value in fields.items()
        if now.get(name, {}).get(key, "(dropped)") != value
    ]
    assert not changed, f"a default of the training sections changed, which breaks mixed releases: {changed}"
    added = [
        f"{name}.{key}" for name, fields in now.items() for key in fields if key not in released.get(name, {})
    ]
    assert not added, (
        f"new fields {added}: add them to tests/released_defaults.json (their defaults are released from then on)"
    )


def test_a_list_from_the_environment_that_is_not_json_is_one_line_naming_the_variable(monkeypatch):
    monkeypatch.setenv("P2PTRAIN_SWARM__INITIAL_PEERS", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWGPqLr56T")
    with pytest.raises(ConfigError) as e:
        load_config(None)
    assert str(e.value).startswith("environment variable P2PTRAIN_SWARM__INITIAL_PEERS: give JSON, e.g. ")
    assert "\n" not in str(e.value)
    monkeypatch.delenv("P2PTRAIN_SWARM__INITIAL_PEERS")
    monkeypatch.setenv("P2PTRAIN_INNER__BETAS", "[0.9")
    with pytest.raises(
        ConfigError, match=r"^environment variable P2PTRAIN_INNER__BETAS: give JSON, .*'\[0.9'"
    ):
        check_fields({})


def test_an_environment_variable_that_would_be_ignored_is_refused(monkeypatch):
    monkeypatch.setenv("P2PTRAIN_WIRETAP", "/tmp/x")  # not a config variable (the bench's), and no typo
    assert load_config(None).inner.lr == ExperimentConfig().inner.lr
    monkeypatch.setenv("P2PTRAIN_INNR__LR", "0.1")
    with pytest.raises(ConfigError, match=r"^environment variable P2PTRAIN_INNR__LR: no section 'innr'"):
        load_config(None)
    monkeypatch.delenv("P2PTRAIN_INNR__LR")
    monkeypatch.setenv("P2PTRAIN_INNER_LR", "0.1")
    with pytest.raises(ConfigError, match=r"two underscores: P2PTRAIN_INNER__LR$"):
        load_config(None)
    monkeypatch.delenv("P2PTRAIN_INNER_LR")
    monkeypatch.setenv("P2PTRAIN_RUN_ID", "x")  # run.run_id is P2PTRAIN_RUN__RUN_ID; run.id is no key
    with pytest.raises(ConfigError, match=r"two underscores: P2PTRAIN_RUN__<KEY>, a key of run_id, seed$"):
        load_config(None)


def test_infinite_values_and_initial_peers_without_a_peer_id_are_refused():
    with pytest.raises(ConfigError, match=r"^command line: inner.lr: Input should be a finite number"):
        load_config(None, parse_set(["inner.lr=.inf"]))
    with pytest.raises(ConfigError, match=r"'/ip4/127.0.0.1/tcp/31337' has no /p2p/<peer id> part"):
        load_config(None, {"swarm": {"initial_peers": ["/ip4/127.0.0.1/tcp/31337"]}})


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("run.run_id=abc\n", r"run.run_id: must be 1-64 characters"),  # "$" matched before a newline
        (
            "inner.betas=[1.5, -2]",
            r"inner.betas: each must be at least 0 and below 1",
        ),  # torch's error, at join
        ("device.num_threads=99999999999999", r"device.num_threads: Input should be less than or equal"),
        ("averaging.block_size=100000000000000", r"averaging.block_size: Input should be less than or equal"),
        ("swarm.bootstrap_timeout_s=1e300", r"swarm.bootstrap_timeout_s: Input should be less than or equal"),
        (
            "swarm.key_file=/dev/zero",
            r"swarm.key_file /dev/zero: not a swarm key \(over 4096 bytes",
        ),  # not read whole
        (
            "data.source=text",
            r"data.path: x+: cannot read it \(File name too long\)",
        ),  # Path.is_dir raised it
    ],
)
def test_values_that_failed_later_or_in_a_traceback_are_refused_naming_the_field(setting, problem):
    sets = [setting] + (["data.path=" + "x" * 300] if setting == "data.source=text" else [])
    overrides = parse_set(sets) if "\n" not in setting else {"run": {"run_id": "abc\n"}}
    with pytest.raises(ConfigError, match=rf"^command line: {problem}"):
        load_config(None, overrides)


def test_a_refused_value_is_named_cut_short_in_a_one_line_error():
    with pytest.raises(ConfigError) as refused:
        load_config(None, {"run": {"run_id": "a" * 100_000}})
    assert len(str(refused.value)) < 200 and "..." in str(refused.value), str(refused.value)[:300]


def test_check_fields_refuses_a_fields_own_problems_and_leaves_checks_between_fields_to_the_config():
    with pytest.raises(ConfigError) as e:
        check_fields({"device": {"kind": "tpu"}, "inner": {"lrr": 1}, "metrics": {"port": 99999}})
    lines = str(e.value).splitlines()
    assert len(lines) == 3 and all(line.startswith("command line: ") for line in lines), lines
    # Wrong against the defaults, maybe right against the swarm's experiment that it joins: not refused here.
    check_fields({"swarm": {"linger_s": 30}})
    with pytest.raises(ConfigError, match="swarm.linger_s"):
        load_config(None, {"swarm": {"linger_s": 30}})


def test_the_environments_value_of_one_field_is_read_in_either_form(monkeypatch):
    from p2ptrain.config import env_value

    assert env_value("run", "run_id") is None
    monkeypatch.setenv("P2PTRAIN_RUN", '{"run_id": "from-json"}')
    assert env_value("run", "run_id") == "from-json"
    monkeypatch.setenv("P2PTRAIN_run__run_id", "from-key")
    assert env_value("run", "run_id") == "from-key"
