import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from p2ptrain import checkpoint
from p2ptrain.checkpoint import PeerDir
from p2ptrain.config import ConfigError, ExperimentConfig
from p2ptrain.diloco import DiLoCo
from p2ptrain.models import build_model


def make(tmp_path):
    cfg = ExperimentConfig()
    cfg.model.name = "gpt-nano"
    cfg.model.context_length = 16
    model = build_model("gpt-nano", 16)
    d = DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True)
    with torch.no_grad():
        for p in d.model_params:
            p.mul_(0.9)
    d.sync(None, weight=1, round=0)
    path = tmp_path / "m.safetensors"
    checkpoint.save(path, model, d, cfg, peer_id="me")
    return cfg, model, d, path


def test_roundtrip_keeps_params_round_and_config(tmp_path):
    cfg, model, d, path = make(tmp_path)
    loaded = checkpoint.load(path)
    assert loaded.round == 1 and loaded.config == cfg
    fresh = build_model("gpt-nano", 16, seed=123)
    checkpoint.load_into(fresh, loaded, path)
    for a, b in zip(fresh.parameters(), model.parameters()):
        assert torch.equal(a, b)
    assert not list(tmp_path.glob("*.tmp")), "no temporary file is left behind"


def test_error_feedback_residuals_are_kept_in_the_file(tmp_path):
    from safetensors.torch import load_file

    from p2ptrain.compression import ErrorFeedback, make_codec

    cfg = ExperimentConfig()
    model = build_model("gpt-nano", 16)
    shapes = [p.shape for p in model.parameters()]
    d = DiLoCo(
        model, lr=0.7, momentum=0.9, nesterov=True, error_feedback=ErrorFeedback(make_codec("int4"), shapes)
    )
    d.error_feedback.residuals[0].fill_(0.25)
    path = tmp_path / "ef.safetensors"
    checkpoint.save(path, model, d, cfg)
    stored = load_file(str(path))
    assert torch.equal(
        stored[checkpoint.RESIDUAL_PREFIX + checkpoint.param_names(model)[0]], d.error_feedback.residuals[0]
    )
    assert not any(k.startswith(checkpoint.RESIDUAL_PREFIX) for k in checkpoint.load(path).params)


def test_corrupted_file_is_refused(tmp_path):
    _, _, _, path = make(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0xFF  # flip bits inside the last tensor's data
    path.write_bytes(bytes(raw))
    loaded = checkpoint.load(path)
    with pytest.raises(checkpoint.CheckpointError, match="recorded hash"):
        checkpoint.load_into(build_model("gpt-nano", 16), loaded, path)


def test_truncated_or_foreign_files_are_refused(tmp_path):
    _, _, _, path = make(tmp_path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(checkpoint.CheckpointError, match="not a readable"):
        checkpoint.load(path)
    with pytest.raises(checkpoint.CheckpointError, match="no such file"):
        checkpoint.load(tmp_path / "missing.safetensors")


def test_load_state_restores_round_params_and_momentum(tmp_path):
    cfg, model, d, path = make(tmp_path)
    state = checkpoint.load_state(model, path, cfg.training_hash())
    assert state.round == 1 and state.residuals == [] and state.inner == {}
    fresh = DiLoCo(build_model("gpt-nano", 16, seed=5), lr=0.7, momentum=0.9, nesterov=True)
    fresh.load_state_tensors(state.outer, round=state.round)
    assert fresh.params_hash() == d.params_hash() and fresh.round == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.momentum_buffers(), d.momentum_buffers()))


def _inner_steps(model, opt, n, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 256, (2, 16), generator=gen)
        loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _with_inner_optimizer(seed=0):
    model = build_model("gpt-nano", 16, seed=seed)
    d = DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True)
    return model, d, torch.optim.AdamW(d.model_params, lr=1e-3)


def test_inner_optimizer_state_and_counters_resume_exactly(tmp_path):
    """Continuing after a restart gives the very params that continuing without one gives."""
    cfg = ExperimentConfig()
    model, d, opt = _with_inner_optimizer()
    _inner_steps(model, opt, 3, seed=0)
    d.sync(None, weight=1, round=0)
    path = tmp_path / "m.safetensors"
    checkpoint.save(path, model, d, cfg, inner_optimizer=opt, counters={"inner_steps_total": 3})

    restored, d2, opt2 = _with_inner_optimizer(seed=9)
    state = checkpoint.load_state(restored, path, cfg.training_hash())
    d2.load_state_tensors(state.outer, round=state.round)
    state.load_inner_into(opt2)
    assert state.counters == {"inner_steps_total": 3}

    _inner_steps(model, opt, 2, seed=1)
    _inner_steps(restored, opt2, 2, seed=1)
    for a, b in zip(model.parameters(), restored.parameters()):
        assert torch.equal(a, b)


def test_corrupted_optimizer_state_is_refused(tmp_path):
    cfg = ExperimentConfig()
    model, d, opt = _with_inner_optimizer()
    _inner_steps(model, opt, 1, seed=0)
    path = tmp_path / "m.safetensors"
    checkpoint.save(path, model, d, cfg, inner_optimizer=opt)
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    name = next(k for k in header if k.startswith(checkpoint.INNER_PREFIX) and k.endswith("exp_avg"))
    raw[8 + header_len + header[name]["data_offsets"][0]] ^= 0xFF  # flip bits of one AdamW moment
    path.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.CheckpointError, match="checksum"):
        checkpoint.load_state(model, path, cfg.training_hash())


def test_load_state_refuses_another_config(tmp_path):
    cfg, model, _, path = make(tmp_path)
    other = cfg.model_copy(deep=True)
    other.inner.lr = 0.123
    with pytest.raises(checkpoint.CheckpointError, match="different experiment config"):
        checkpoint.load_state(model, path, other.training_hash())


def test_prune_keeps_the_newest_periodic_checkpoints(tmp_path):
    for r in range(1, 6):
        (tmp_path / f"round-{r:06d}.safetensors").write_bytes(b"x")
    (tmp_path / "final.safetensors").write_bytes(b"x")
    checkpoint.prune(tmp_path, keep_last=2)
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "final.safetensors",
        "round-000004.safetensors",
        "round-000005.safetensors",
    ]


def test_prune_goes_by_round_past_a_million_rounds(tmp_path):
    for r in (999_998, 999_999, 1_000_000):
        (tmp_path / f"round-{r:06d}.safetensors").write_bytes(b"x")
    checkpoint.prune(tmp_path, keep_last=2)
    assert sorted(f.name for f in tmp_path.iterdir()) == [
        "round-1000000.safetensors",
        "round-999999.safetensors",
    ]


def test_temporary_files_of_a_save_killed_midway_are_removed_when_the_directory_is_claimed(tmp_path):
    _, _, _, path = make(tmp_path)
    stale = tmp_path / "round-000004.safetensorsk3j_x1q.tmp"  # as save's mkstemp names them
    stale.write_bytes(b"half a checkpoint")
    other = tmp_path / "notes.tmp"  # not ours: left alone
    other.write_text("x")
    held = PeerDir.claim(tmp_path, "run")
    try:
        assert not stale.exists() and other.exists() and path.exists()
    finally:
        held.release()


def test_a_checkpoint_whose_counters_are_not_whole_numbers_is_refused_and_an_older_one_resumed(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = ExperimentConfig()
    model, d, opt = _with_inner_optimizer()
    _inner_steps(model, opt, 1, seed=0)
    older = tmp_path / "round-000001.safetensors"
    checkpoint.save(older, model, d, cfg, inner_optimizer=opt, counters={"inner_steps_total": 1})
    newer = tmp_path / "round-000002.safetensors"
    with safe_open_metadata(older) as original:
        crafted = {**original, "counters": '{"inner_steps_total": Infinity}'}
    save_file(load_file(str(older)), str(newer), metadata=crafted)
    os.utime(older, (time.time() - 60, time.time() - 60))
    refused = []
    restored, d2, opt2 = _with_inner_optimizer(seed=9)
    got = checkpoint.resume_latest(
        tmp_path, restored, d2, opt2, cfg.training_hash(), on_refused=lambda p, why: refused.append((p, why))
    )
    assert got is not None and got[0] == older and got[1].counters == {"inner_steps_total": 1}
    assert refused == [(newer, f"{newer}: unreadable counters in its metadata")]


def test_resume_goes_by_the_round_a_file_holds_not_by_when_it_was_written(tmp_path):
    """A copy or a restore from a backup gives an older round the newest time: the newest round still wins,
    and a file whose round cannot be read is tried last (and refused, saying why)."""
    cfg = ExperimentConfig()
    model, d, opt = _with_inner_optimizer()
    for round_ in (0, 1, 2):
        d.sync(None, weight=1, round=round_)
        checkpoint.save(tmp_path / f"round-{round_:06d}.safetensors", model, d, cfg, inner_optimizer=opt)
    now = time.time()
    for age, name in ((300, "round-000002"), (200, "round-000001"), (100, "round-000000")):
        os.utime(tmp_path / f"{name}.safetensors", (now - age, now - age))
    (tmp_path / "interrupted.safetensors").write_bytes(b"not a model file")
    assert [p.stem for p in checkpoint.candidates(tmp_path)] == [
        "round-000002",
        "round-000001",
        "round-000000",
        "interrupted",
    ]
    restored, d2, opt2 = _with_inner_optimizer(seed=9)
    got = checkpoint.resume_latest(tmp_path, restored, d2, opt2, cfg.training_hash())
    assert got is not None and got[0].stem == "round-000002" and got[1].round == d.round


@pytest.mark.parametrize(
    "metadata, reason",
    [
        ({"round": None}, "its round is not a whole number"),
        ({"round": "three"}, "its round is not a whole number"),
        ({"round": "-1"}, "its round is not a whole number"),
        ({"round": "\u00b2"}, "its round is not a whole number"),
        ({"config": "[" * 100_000 + "]" * 100_000}, "its embedded config is not valid JSON"),
        ({"config": json.dumps({"inner": {"lr": "fast"}, "model": {"name": "gpt-huge"}})}, "is invalid: "),
        ({"config": None}, "it carries no experiment config"),
        ({"config": "[1, 2]"}, "not a mapping of sections"),
        (
            {"config": json.dumps({"inner": {"lr_wobble": 2.0}})},
            "inner.lr_wobble: unknown key (a newer release",
        ),
    ],
)
def test_a_crafted_model_file_is_a_one_line_error(tmp_path, metadata, reason):
    """A model file can come from anyone: every bad metadata field is a CheckpointError of one line."""
    from safetensors.torch import load_file, save_file

    _, _, _, path = make(tmp_path)
    with safe_open_metadata(path) as original:
        crafted = {k: v for k, v in {**original, **metadata}.items() if v is not None}
    bad = tmp_path / "crafted.safetensors"
    save_file(load_file(str(path)), str(bad), metadata=crafted)
    with pytest.raises(checkpoint.CheckpointError) as e:
        checkpoint.load(bad)
    assert reason in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 1000


def safe_open_metadata(path):
    import contextlib

    from safetensors import safe_open

    @contextlib.contextmanager
    def opened():
        with safe_open(str(path), framework="pt") as f:
            yield dict(f.metadata())

    return opened()


def test_each_peer_gets_a_directory_of_its_own_and_a_restarted_one_takes_its_back(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first, second = PeerDir.claim(None, "run"), PeerDir.claim(None, "run")
    assert (first.path, second.path) == (Path("checkpoints/run/peer-0"), Path("checkpoints/run/peer-1"))
    first.release()  # as the kernel does when its peer exits, even by kill -9
    again = PeerDir.claim(None, "run")
    assert again.path == Path("checkpoints/run/peer-0")
    with pytest.raises(
        ConfigError,
        match=f"checkpoint.dir checkpoints/run/peer-1: another running peer \\(pid {os.getpid()}\\)",
    ):
        PeerDir.claim(Path("checkpoints/run/peer-1"), "run")
    for held in (second, again):
        held.release()


def test_a_forked_child_does_not_keep_its_parents_directory(tmp_path):
    held = PeerDir.claim(tmp_path / "peer", "run")
    ready, say_ready = os.pipe()
    child = os.fork()
    if child == 0:  # as hivemind's DHT and averager children: they outlive a killed parent for a while
        os.write(say_ready, b"1")  # the fork's handlers have run
        time.sleep(60)
        os._exit(0)
    try:
        assert os.read(ready, 1) == b"1"
        held.release()
        PeerDir.claim(tmp_path / "peer", "run").release()  # the child's copy of the lock was closed at fork
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        os.close(ready)
        os.close(say_ready)


def test_what_a_peer_saw_of_another_experiment_is_not_restored(tmp_path):
    model = build_model("gpt-nano", 16)
    diloco = DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True)
    cfg = ExperimentConfig()
    cfg.model.name, cfg.model.context_length = "gpt-nano", 16
    seen = {"highest_round": 3}
    checkpoint.save(tmp_path / "final.safetensors", model, diloco, cfg, swarm=seen)
    assert checkpoint.read_swarm_memory(tmp_path / "final.safetensors", cfg.training_hash()) == seen
    other = cfg.model_copy(deep=True)
    other.run.run_id = "another-run"
    assert checkpoint.read_swarm_memory(tmp_path / "final.safetensors", other.training_hash()) == {}


def test_a_model_file_embeds_only_what_differs_from_the_defaults_and_reads_back_whole(tmp_path):
    """An older release leaves out the fields it lacks; a newer one reads them back as their defaults."""
    _, _, _, path = make(tmp_path)
    with safe_open_metadata(path) as metadata:
        embedded = json.loads(metadata["config"])
    loaded = checkpoint.load(path)
    assert "inner" not in embedded or "max_steps_while_waiting" not in embedded["inner"]
    assert loaded.config.inner.max_steps_while_waiting == 0
    assert (
        checkpoint.ExperimentConfig.model_validate(embedded).training_hash() == loaded.config.training_hash()
    )


def test_a_checkpoints_config_reads_back_packed_or_not(tmp_path):
    """averaging.packed left out of an embedded config means false (config.ABSENT_MEANS), as older releases
    wrote it; true is written out."""
    for packed in (True, False):
        cfg = checkpoint.ExperimentConfig.model_validate({"averaging": {"packed": packed}})
        embedded = json.loads(cfg.to_json())
        assert ("packed" in embedded.get("averaging", {})) is packed
        assert checkpoint._embedded_config(tmp_path / "x", cfg.to_json()).averaging.packed is packed
    assert checkpoint._embedded_config(tmp_path / "x", "{}").averaging.packed is False


def test_a_model_file_reads_back_as_written_whatever_the_readers_environment(tmp_path, monkeypatch):
    cfg, _, _, path = make(tmp_path)
    monkeypatch.setenv("P2PTRAIN_INNER__LR", "0.5")  # would fill a field the file leaves out, were it read
    monkeypatch.setenv("P2PTRAIN_MODEL__NAME", "gpt-micro")
    loaded = checkpoint.load(path)
    assert loaded.config.inner.lr == cfg.inner.lr and loaded.config.model.name == "gpt-nano"
    assert loaded.config == cfg


def test_a_checkpoint_of_the_release_that_hashed_every_field_resumes_after_an_upgrade(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg, model, _, path = make(tmp_path)
    with safe_open_metadata(path) as metadata:
        older = dict(metadata, config_hash=cfg.training_hash(every_field=True))
    old = tmp_path / "older.safetensors"
    save_file(load_file(str(path)), str(old), metadata=older)
    assert cfg.training_hash(every_field=True) != cfg.training_hash()
    with pytest.raises(checkpoint.CheckpointError, match="different experiment config"):
        checkpoint.load_state(model, old, cfg.training_hash())
    assert checkpoint.load_state(model, old, cfg.resumable_hashes()).round == 1


def test_a_model_files_params_hash_takes_any_dtype_and_float32_as_numpy_bytes():
    # A file may hold bfloat16 (a crafted one, or a future release's): its hash is no traceback.
    import hashlib

    from p2ptrain.checkpoint import LoadedModel

    params = {"b": torch.randn(5), "a": torch.randn(3, 4)}
    expected = hashlib.sha256(b"".join(params[n].numpy().tobytes() for n in sorted(params))).hexdigest()
    assert LoadedModel(config=None, round=0, params=params, metadata={}).params_sha256() == expected
    half = {n: t.bfloat16() for n, t in params.items()}
    assert len(LoadedModel(config=None, round=0, params=half, metadata={}).params_sha256()) == 64
