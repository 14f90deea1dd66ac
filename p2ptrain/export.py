"""A model file as a Hugging Face folder: ``p2ptrain export CHECKPOINT --out DIR``.

The folder holds ``config.json`` (a ``LlamaConfig``), ``model.safetensors`` (the params under their own names,
which are ``LlamaForCausalLM``'s: ``models.Llama`` is built to match) and, when the run trained on a prepared
BPE corpus, its ``tokenizer.json`` with a ``tokenizer_config.json``: ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` open it, offline. Writing it needs no ``transformers``.

Only Llama-shaped models export: the GPTs of the zoo have no Hugging Face class of the same computation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from p2ptrain import checkpoint
from p2ptrain.models import ZOO, LlamaShape
from p2ptrain.prepare import END_OF_TEXT, TOKENIZER_FILE, Manifest, PrepareError


class ExportError(ValueError):
    """The model file cannot be exported as asked; the message says why."""


def export(path: Path, out: Path) -> dict:
    """Write ``path``'s model into ``out`` (created; files of the same names replaced). Returns config.json.

    Raises:
        CheckpointError: not a readable model file.
        ExportError: not a Llama-shaped model.
    """
    loaded = checkpoint.load(path)
    cfg = loaded.config
    shape = ZOO[cfg.model.name]
    if not isinstance(shape, LlamaShape):
        raise ExportError(
            f"{path}: model.name {cfg.model.name} has no Hugging Face class; only llama-* models export"
        )
    params = {name: t.contiguous() for name, t in loaded.params.items()}
    vocab_size = int(params["model.embed_tokens.weight"].shape[0])
    manifest = _manifest(cfg.data)
    end_of_text = manifest.end_of_text if manifest is not None else None
    config = {
        **hf_config(cfg.model.name, cfg.model.context_length, vocab_size, end_of_text),
        "p2ptrain": {"run_id": cfg.run.run_id, "round": loaded.round, "params_hash": loaded.params_sha256()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(params, str(out / "model.safetensors"), metadata={"format": "pt"})
    if manifest is not None and manifest.tokenizer == "bpe":
        assert cfg.data.path is not None
        shutil.copyfile(Path(cfg.data.path) / TOKENIZER_FILE, out / TOKENIZER_FILE)
        tokenizer_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": END_OF_TEXT,
            "bos_token": END_OF_TEXT,
            "model_max_length": cfg.model.context_length,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return config


def hf_config(name: str, context_length: int, vocab_size: int, end_of_text: int | None = None) -> dict:
    """The ``LlamaConfig`` (as config.json's fields) of zoo model ``name``: what makes ``LlamaForCausalLM``
    compute what ``models.Llama`` computes."""
    shape = ZOO[name]
    assert isinstance(shape, LlamaShape), name
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": shape.n_embd,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.n_layer,
        "num_attention_heads": shape.n_head,
        "num_key_value_heads": shape.n_kv_head,
        "head_dim": shape.n_embd // shape.n_head,
        "hidden_act": "silu",
        "max_position_embeddings": context_length,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": shape.tie_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": end_of_text,
        "eos_token_id": end_of_text,
        "torch_dtype": "float32",
    }


def _manifest(data) -> Manifest | None:
    if data.source != "prepared":
        return None
    try:
        return Manifest.read(Path(data.path))
    except PrepareError as e:
        raise ExportError(f"the run's prepared data, for its tokenizer: {e}") from None
