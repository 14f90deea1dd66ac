"""The swarm's published experiment: signed by its owner, chosen by how many peers carry it, and a joiner's
config made from it or refused with the fields that differ (p2ptrain/experiment.py)."""

import dataclasses
import os
from types import SimpleNamespace

import pytest
from hivemind.dht.schema import RSASignatureValidator
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.timed_storage import ValueWithExpiration

from p2ptrain.config import ConfigError, load_config, training_defaults
from p2ptrain.experiment import (
    ExperimentError,
    check,
    choose,
    config_for,
    digest,
    published,
    sign,
    subkey,
    verified,
)
from p2ptrain.membership import peer_id_of

TINY = {
    "run": {"run_id": "exp-test"},
    "model": {"name": "gpt-nano", "context_length": 32},
    "inner": {"num_inner_steps": 5, "batch_size": 8},
    "outer": {"num_rounds": 3},
}


@pytest.fixture(scope="module")
def keys():
    return [RSAPrivateKey() for _ in range(3)]


def cfg_of(**changes):
    sections = {k: dict(v) for k, v in TINY.items()}
    for dotted, value in changes.items():
        section, name = dotted.split("__")
        sections.setdefault(section, {})[name] = value
    return load_config(None, sections)


def carried(*entries):
    """A DHT value of p2ptrain_experiments: (publisher key, record) pairs."""
    value = {}
    for key, record in entries:
        marker = RSASignatureValidator(key).local_public_key
        value[subkey(record.run_id, marker)] = ValueWithExpiration(record.dict(), 0.0)
    return SimpleNamespace(value=value)


def test_a_signed_experiment_verifies_and_names_its_owner(keys):
    record = sign(cfg_of(), keys[0])
    found = verified(record)
    assert found is not None and found.run_id == "exp-test"
    assert found.owner == peer_id_of(keys[0].get_public_key())
    assert found.sections["model"]["name"] == "gpt-nano" and "path" not in found.sections["data"]
    assert len(found.sections["data"]["sha256"]) == 64


def test_a_tampered_or_forged_experiment_is_refused(keys):
    record = sign(cfg_of(), keys[0])
    tampered = record.sections.replace('"num_rounds":3', '"num_rounds":30')
    assert tampered != record.sections and verified(record.copy(update={"sections": tampered})) is None
    other = sign(cfg_of(**{"inner__lr": 0.2}), keys[1])
    assert verified(record.copy(update={"signature": other.signature})) is None, "another key's signature"
    assert verified(record.copy(update={"owner_key": other.owner_key})) is None
    assert verified(record.copy(update={"run_id": "other-run"})) is None, "signed for another run"
    assert verified(record.copy(update={"created": record.created + 1})) is None


def test_a_signed_experiment_nested_deeper_than_a_config_is_refused(keys):
    """An insider signs what it likes: ~990 nested mappings in a field made the joiner's comparison overflow
    its recursion (a traceback at join) instead of refusing the record (found by a review)."""
    import json

    from p2ptrain.experiment import _signed_bytes

    record = sign(cfg_of(), keys[0])
    sections = json.loads(record.sections)
    sections["inner"]["lr"] = "LR"
    template = json.dumps(sections, separators=(",", ":"), sort_keys=True)

    def signed(value: str):
        text = template.replace('"LR"', value)
        signature = keys[0].sign(_signed_bytes(record.run_id, text, record.created))
        return verified(record.copy(update={"sections": text, "signature": signature}))

    for value in ("{" + '"a":{' * 990 + "}" * 991, "[[1]]", '[{"a":1}]', '{"a":1}'):
        assert signed(value) is None, value[:20]
    assert signed("0.5") is not None and signed("[0.5,0.9]") is not None  # values, and lists of them


def test_published_counts_the_peers_that_carry_each_experiment(keys):
    mine = sign(cfg_of(), keys[0])
    theirs = sign(cfg_of(**{"inner__lr": 0.2}), keys[2])
    found = published(carried((keys[0], mine), (keys[1], mine), (keys[2], theirs)))
    by_owner = {e.owner: e for e in found}
    assert len(by_owner[peer_id_of(keys[0].get_public_key())].publishers) == 2
    assert len(by_owner[peer_id_of(keys[2].get_public_key())].publishers) == 1
    assert choose(found, "exp-test").record == mine, "the experiment most peers carry"


def test_a_record_filed_under_another_runs_subkey_or_forged_is_skipped(keys):
    record = sign(cfg_of(), keys[0])
    value = carried((keys[0], record)).value
    marker = RSASignatureValidator(keys[1]).local_public_key
    value[b"other-run" + marker] = ValueWithExpiration(record.dict(), 0.0)
    forged = record.dict() | {"signature": b"x" * 256}
    value[b"exp-test" + RSASignatureValidator(keys[2]).local_public_key] = ValueWithExpiration(forged, 0.0)
    value[b"exp-test"] = ValueWithExpiration(record.dict(), 0.0)  # no publisher
    (found,) = published(SimpleNamespace(value=value))
    assert found.publishers == {peer_id_of(keys[0].get_public_key())}


def test_choose_needs_a_run_id_when_the_swarm_trains_several(keys):
    a = verified(sign(cfg_of(), keys[0]))
    b = verified(sign(cfg_of(**{"run__run_id": "other"}), keys[1]))
    assert a is not None and b is not None
    with pytest.raises(ExperimentError, match="several runs \\(exp-test, other\\).*--run-id"):
        choose([a, b])
    assert choose([a, b], "other") == b
    assert choose([a], None) == a
    assert choose([a], "missing") is None
    older = dataclasses.replace(a, created=a.created - 10, digest="z")
    assert choose([a, older], "exp-test") == older, "a tie goes to the earliest"


def test_a_config_that_differs_is_refused_naming_every_field(keys):
    published_ = verified(sign(cfg_of(), keys[0]))
    assert published_ is not None
    check(cfg_of(), published_)
    with pytest.raises(ConfigError) as e:
        check(cfg_of(**{"inner__lr": 0.001, "outer__num_rounds": 5}), published_)
    message = str(e.value)
    assert "\n" not in message
    assert "inner.lr: 0.001 here, 0.002 in the swarm" in message
    assert "outer.num_rounds: 5 here, 3 in the swarm" in message
    assert "exp-test" in message


def test_a_published_experiment_with_values_of_the_wrong_kind_is_one_line_never_a_traceback(keys):
    ours = verified(sign(cfg_of(), keys[0]))
    assert ours is not None
    for data in ({"source": ["text"]}, {"source": "text", "sha256": 5}, {"source": {"x": 1}}):
        sections = {**ours.sections, "data": {**ours.sections["data"], **data}}
        crafted = dataclasses.replace(ours, sections=sections, digest=digest(sections))
        with pytest.raises(ConfigError) as refused:
            config_for(crafted)
        assert "\n" not in str(refused.value), data


def test_releases_mix_a_field_left_out_is_its_default_and_a_newer_ones_field_is_named(keys):
    cfg = cfg_of()
    ours = verified(sign(cfg, keys[0]))
    assert ours is not None and "max_steps_while_waiting" not in ours.sections["inner"]
    # An older release wrote every field, defaults included: the same experiment, accepted as it is.
    full = cfg.training_sections(every_field=True)
    assert full["inner"]["max_steps_while_waiting"] == 0
    older = dataclasses.replace(ours, sections=full, digest=digest(full))
    assert older.digest == ours.digest
    check(cfg, older)
    assert config_for(older).training_hash() == cfg.training_hash()
    with pytest.raises(ConfigError, match="inner.lr: 0.001 here, 0.002 in the swarm"):
        check(cfg_of(inner__lr=0.001), older)
    # A newer release's field, set in the swarm: named, with what to do; never a traceback.
    newer_sections = {**ours.sections, "inner": {**ours.sections["inner"], "lr_wobble": 2.0}}
    newer = dataclasses.replace(ours, sections=newer_sections, digest=digest(newer_sections))
    with pytest.raises(ConfigError) as e:
        config_for(newer)
    assert (
        "inner.lr_wobble" in str(e.value) and "upgrade p2ptrain" in str(e.value) and "\n" not in str(e.value)
    )
    with pytest.raises(ConfigError, match="inner.lr_wobble: not known to this p2ptrain, 2.0 in the swarm"):
        check(cfg, newer)


NEWER_WIRE = ["packed", "agreed_groups", "settled_groups"]


@pytest.mark.parametrize("field", NEWER_WIRE)
def test_a_run_of_an_older_release_is_joined_with_its_wire(keys, field):
    """averaging.packed, agreed_groups and settled_groups are new and on by default, yet a run that leaves
    them out (an older release's) means false (config.ABSENT_MEANS): its joiners send tensor by tensor,
    average under the leader's group id and neither publish nor wait for groups, as its older peers do."""
    cfg = cfg_of()
    ours = verified(sign(cfg, keys[0]))
    assert ours is not None and ours.sections["averaging"][field] is True  # said, so an older one refuses
    assert field not in cfg_of(**{f"averaging__{field}": False}).training_sections()["averaging"]
    old_sections = {**ours.sections, "averaging": {}}
    older = dataclasses.replace(ours, sections=old_sections, digest=digest(old_sections))
    joiner = config_for(older)
    assert getattr(joiner.averaging, field) is False
    check(cfg_of(**{f"averaging__{f}": False for f in NEWER_WIRE}), older)
    with pytest.raises(ConfigError, match=f"averaging.{field}: true here, false in the swarm"):
        check(cfg_of(**{f"averaging__{f}": False for f in NEWER_WIRE if f != field}), older)
    with pytest.raises(ConfigError, match=f"averaging.{field}"):
        config_for(older, {"averaging": {field: True}})


def test_the_built_in_default_experiment_is_published_under_its_run_id(keys):
    found = verified(sign(load_config(None, {}), keys[0]))
    assert found is not None and found.run_id == "p2ptrain-default"
    assert found.sections["run"] == {"run_id": "p2ptrain-default"}


def test_the_training_hash_does_not_see_fields_set_to_their_defaults():
    defaults = load_config(None, {}).model_dump(mode="json")
    explicit = {
        name: {k: v for k, v in fields.items() if (name, k) != ("data", "path")}
        for name, fields in defaults.items()
        if name in training_defaults()
    }
    assert load_config(None, explicit).training_hash() == load_config(None, {}).training_hash()
    assert load_config(None, {}).training_sections()["inner"] == {}
    # A field whose absence means other than its default (config.ABSENT_MEANS) is published at its default,
    # and left out at the value that older releases, which do not know it, train with.
    assert load_config(None, {}).training_sections()["outer"] == {"overlap": True}
    assert load_config(None, {"outer": {"overlap": False}}).training_sections()["outer"] == {}


def test_timeouts_and_group_sizes_are_each_peers_own(keys):
    published_ = verified(sign(cfg_of(**{"averaging__allreduce_timeout_s": 90.0}), keys[0]))
    assert published_ is not None
    check(cfg_of(**{"averaging__target_group_size": 3, "verification__reveal_timeout_s": 5.0}), published_)
    check(cfg_of(**{"outer__overlap_carry": 1.0}), published_)  # what it keeps of its own stale steps
    assert cfg_of(**{"outer__overlap_carry": 1.0}).training_hash() == cfg_of().training_hash()
    with pytest.raises(ConfigError, match="averaging.compression"):
        check(cfg_of(**{"averaging__compression": "int4"}), published_)


def test_a_joiner_takes_the_swarms_sections_and_its_own(keys):
    owner_cfg = cfg_of(**{"averaging__allreduce_timeout_s": 90.0, "inner__lr": 0.003})
    published_ = verified(sign(owner_cfg, keys[0]))
    assert published_ is not None
    cfg = config_for(published_, {"device": {"num_threads": 1}, "averaging": {"retries": 0}})
    assert cfg.agreed_sections() == owner_cfg.agreed_sections()
    assert cfg.averaging.allreduce_timeout_s == 90.0, "the run's own values are a joiner's defaults"
    assert cfg.averaging.retries == 0 and cfg.device.num_threads == 1
    with pytest.raises(ConfigError, match="inner.lr: 0.01 here, 0.003 in the swarm"):
        config_for(published_, {"inner": {"lr": 0.01}})


def test_a_joiner_gives_its_copy_of_a_text_corpus_checked_by_content(keys, tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the swarm's corpus. " * 500)
    published_ = verified(sign(cfg_of(**{"data__source": "text", "data__path": str(corpus)}), keys[0]))
    assert published_ is not None
    with pytest.raises(ConfigError, match="trains on a text file .*--set data.path=FILE"):
        config_for(published_, {})
    copy = tmp_path / "elsewhere" / "mine.txt"
    copy.parent.mkdir()
    copy.write_bytes(corpus.read_bytes())
    monkeypatch.chdir(tmp_path)
    assert config_for(published_, {"data": {"path": os.path.relpath(copy)}}).data.path is not None
    monkeypatch.setenv("P2PTRAIN_DATA__PATH", str(copy))  # as the systemd unit and the image give it
    assert config_for(published_, {}).data.path == copy
    monkeypatch.delenv("P2PTRAIN_DATA__PATH")
    other = tmp_path / "other.txt"
    other.write_bytes(b"another corpus, same size " * 385)
    with pytest.raises(ConfigError, match="data.sha256: .* here, .* in the swarm.*holds other data"):
        config_for(published_, {"data": {"path": str(other)}})


def test_the_training_hash_follows_the_data_not_its_path(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"some text for the hash. " * 400)
    monkeypatch.chdir(tmp_path)
    relative = cfg_of(**{"data__source": "text", "data__path": "corpus.txt"})
    absolute = cfg_of(**{"data__source": "text", "data__path": str(corpus)})
    assert relative.training_hash() == absolute.training_hash()
    before = absolute.training_hash()
    corpus.write_bytes(b"other text under that path " * 400)
    os.utime(corpus, ns=(1, 1))  # a new mtime, whatever the clock's resolution
    assert absolute.training_hash() != before


def test_a_joiner_with_the_same_prepared_tokens_is_taken_and_one_with_other_tokens_refused(keys, tmp_path):
    from p2ptrain.prepare import prepare

    text = tmp_path / "corpus.txt"
    text.write_bytes(b"the swarm's corpus. " * 500)
    prepare([str(text)], tmp_path / "owner")
    published_ = verified(sign(cfg_of(data__source="prepared", data__path=str(tmp_path / "owner")), keys[0]))
    assert published_ is not None
    with pytest.raises(ConfigError, match=r"trains on a prepared corpus .*--set data.path=DIR"):
        config_for(published_, {})
    prepare([str(text)], tmp_path / "mine")  # prepared again elsewhere: the same tokens
    assert config_for(published_, {"data": {"path": str(tmp_path / "mine")}}).data.path == tmp_path / "mine"
    prepare([str(text)], tmp_path / "bpe", tokenizer="bpe", vocab_size=300)  # same text, other tokens
    with pytest.raises(ConfigError, match="data.sha256: .* here, .* in the swarm"):
        config_for(published_, {"data": {"path": str(tmp_path / "bpe")}})


def test_a_peer_whose_python_ships_other_documentation_text_is_told_so(keys):
    """The default corpus is the pydoc text of the peer's own Python, which changes between releases (3.11.2
    and 3.11.7 differ): a refusal that named data.path, which such a peer never set, would not help it."""
    found = verified(sign(cfg_of(), keys[0]))
    assert found is not None and cfg_of().data.source == "pydoc"
    data = {**found.sections["data"], "sha256": "0" * 64}
    other_python = dataclasses.replace(found, sections={**found.sections, "data": data})
    with pytest.raises(
        ConfigError, match=r"data.sha256: .*ships other documentation text .*python --version"
    ):
        check(cfg_of(), other_python)


def test_a_volunteers_file_is_below_the_environment_and_the_flags(keys, monkeypatch, tmp_path):
    """As for any config file: deploy's systemd unit and image set P2PTRAIN_CHECKPOINT__DIR and the like,
    which a volunteer's file silently beat when it was merged into the flags."""
    found = verified(sign(cfg_of(), keys[0]))
    assert found is not None
    own = {"checkpoint": {"dir": str(tmp_path / "file")}, "device": {"num_threads": 2}}
    assert str(config_for(found, {}, own).checkpoint.dir) == str(tmp_path / "file")
    monkeypatch.setenv("P2PTRAIN_CHECKPOINT__DIR", str(tmp_path / "env"))
    cfg = config_for(found, {"device": {"num_threads": 1}}, own)
    assert str(cfg.checkpoint.dir) == str(tmp_path / "env") and cfg.device.num_threads == 1
