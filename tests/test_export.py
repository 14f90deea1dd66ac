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


def test_a_bpe_runs_tokenizer_goes_with_it_and_the_model_generates_text(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the cat sat on the mat. " * 400)
    manifest = prepare([str(text)], tmp_path / "data", tokenizer="bpe", vocab_size=300)
    _, path = saved(
        tmp_path, "llama-nano", manifest.vocab_size, {"source": "prepared", "path": str(tmp_path / "data")}
    )
    export(path, tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    ids = tokenizer("the cat", return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=manifest.end_of_text)
    assert out.shape[1] > ids.shape[1] and isinstance(tokenizer.decode(out[0]), str)
    assert tokenizer.eos_token_id == manifest.end_of_text


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
