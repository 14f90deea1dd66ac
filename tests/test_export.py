"""Llama-shaped models: the same computation as Hugging Face's LlamaForCausalLM, exported as a folder that
transformers opens offline (same logits), with the run's BPE tokenizer; GPTs are refused with one line."""

from __future__ import annotations

import pytest
import torch
import transformers  # a dev dependency (`make setup`); p2ptrain itself never imports it

from p2ptrain import checkpoint
from p2ptrain.config import load_config
from p2ptrain.diloco import DiLoCo
from p2ptrain.export import ExportError, export
from p2ptrain.models import build_model
from p2ptrain.prepare import prepare


def saved(tmp_path, name, vocab_size=256, data=None):
    cfg = load_config(
        None, {"model": {"name": name, "context_length": 32}, **({"data": data} if data else {})}
    )
    model = build_model(name, 32, seed=3, vocab_size=vocab_size)
    path = tmp_path / "final.safetensors"
    checkpoint.save(path, model, DiLoCo(model, lr=0.7, momentum=0.5, nesterov=True), cfg, peer_id="me")
    return model, path


def test_an_exported_llama_gives_transformers_the_same_logits(tmp_path):
    model, path = saved(tmp_path, "llama-nano")  # 2 heads, 2 key/value heads, tied embeddings
    config = export(path, tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(idx), hf(idx).logits
    assert config["vocab_size"] == 256 and torch.allclose(ours, theirs, atol=1e-4), (
        (ours - theirs).abs().max()
    )


def test_grouped_query_attention_matches_too(tmp_path):
    model, path = saved(tmp_path, "llama-micro")  # 4 heads, 2 key/value heads
    export(path, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    idx = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(model.eval()(idx), hf(idx).logits, atol=1e-4)


def saved_on_bpe(tmp_path):
    """A llama trained (as saved) on a prepared BPE corpus in tmp_path/data: (its text, manifest, model file)."""
    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat on the mat. " * 400)
    manifest = prepare([str(text)], tmp_path / "data", tokenizer="bpe", vocab_size=300)
    _, path = saved(
        tmp_path, "llama-nano", manifest.vocab_size, {"source": "prepared", "path": str(tmp_path / "data")}
    )
    return text, manifest, path


def test_a_bpe_runs_tokenizer_goes_with_it_and_the_model_generates_text(tmp_path):
    _, manifest, path = saved_on_bpe(tmp_path)
    export(path, tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    ids = tokenizer("the cat", return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=manifest.end_of_text)
    assert out.shape[1] > ids.shape[1] and isinstance(tokenizer.decode(out[0]), str)
    assert tokenizer.eos_token_id == manifest.end_of_text


def test_a_bpe_model_over_other_prepared_data_is_refused_and_a_byte_export_leaves_no_stale_tokenizer(
    tmp_path,
):
    text, _, path = saved_on_bpe(tmp_path)
    export(path, tmp_path / "hf")
    assert (tmp_path / "hf" / "tokenizer.json").exists()
    # The same folder exported again from a byte-level model: no tokenizer of another model left beside it.
    (tmp_path / "bytes").mkdir()
    _, byte_model = saved(tmp_path / "bytes", "llama-nano")
    export(byte_model, tmp_path / "hf")
    assert sorted(f.name for f in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    # The run's prepared folder replaced by another corpus under the same path: its tokenizer is not the model's.
    text.write_text("a dog ran in the fog. " * 400)
    prepare([str(text)], tmp_path / "data2", tokenizer="bpe", vocab_size=300)
    (tmp_path / "data").rename(tmp_path / "data-old")
    (tmp_path / "data2").rename(tmp_path / "data")
    with pytest.raises(ExportError, match="is not what the run trained on"):
        export(path, tmp_path / "hf2")


def test_a_corrupted_or_crafted_model_file_is_refused_before_anything_is_written(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    _, path = saved(tmp_path, "llama-nano")
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1.0  # changed after it was hashed
    save_file(tensors, str(tmp_path / "changed.safetensors"), metadata=metadata)
    with pytest.raises(checkpoint.CheckpointError, match="do not match their recorded hash"):
        export(tmp_path / "changed.safetensors", tmp_path / "hf")
    tensors = load_file(str(path))
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)  # was a TypeError
    save_file(tensors, str(tmp_path / "bf16.safetensors"), metadata=metadata)
    with pytest.raises(checkpoint.CheckpointError, match="do not match their recorded hash"):
        export(tmp_path / "bf16.safetensors", tmp_path / "hf")
    del tensors["model.embed_tokens.weight"]  # was a KeyError
    save_file(tensors, str(tmp_path / "no-embedding.safetensors"), metadata=metadata)
    with pytest.raises(ExportError, match="no token embedding"):
        export(tmp_path / "no-embedding.safetensors", tmp_path / "hf")
    tensors["model.embed_tokens.weight"] = torch.zeros(10**9, 0)  # no bytes, yet a model of 10^9 ids to build
    save_file(tensors, str(tmp_path / "huge-vocabulary.safetensors"), metadata=metadata)
    with pytest.raises(ExportError, match=r"has shape \[1000000000, 0\]; model llama-nano's embeddings are"):
        export(tmp_path / "huge-vocabulary.safetensors", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_gpt_is_refused_in_one_line(tmp_path):
    _, path = saved(tmp_path, "gpt-nano")
    with pytest.raises(ExportError, match="model.name gpt-nano has no Hugging Face class; only llama"):
        export(path, tmp_path / "hf")


def test_the_export_command_writes_the_folder_and_refuses_a_gpt_in_one_line(tmp_path):
    import subprocess
    import sys

    _, path = saved(tmp_path, "llama-nano")
    out = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "export", str(path), "--out", str(tmp_path / "hf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "LlamaForCausalLM, 2 layers x 64, 256 ids, round 0, byte ids (no tokenizer)" in out.stdout
    assert (tmp_path / "hf" / "config.json").exists() and (tmp_path / "hf" / "model.safetensors").exists()
    (tmp_path / "gpt").mkdir()
    _, gpt = saved(tmp_path / "gpt", "gpt-nano")
    bad = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "export", str(gpt), "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and "only llama-* models export" in lines[0]
