"""A model file as a Hugging Face folder: ``p2ptrain export CHECKPOINT --out DIR``.

The folder holds ``config.json`` (a ``LlamaConfig``), ``model.safetensors`` (the params under their own names,
which are ``LlamaForCausalLM``'s: ``models.Llama`` is built to match) and, when the run trained on a prepared
BPE corpus, its ``tokenizer.json`` with a ``tokenizer_config.json``: ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` open it, offline. Writing it needs no ``transformers``.

Only Llama-shaped models export: the GPTs of the zoo have no Hugging Face class of the same computation.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from p2ptrain import checkpoint
from p2ptrain.models import ZOO, LlamaShape, build_model
from p2ptrain.prepare import END_OF_TEXT, MAX_VOCAB, TOKENIZER_FILE, Manifest, PrepareError


class ExportError(ValueError):
    """The model file cannot be exported as asked; the message says why."""


OUTPUT_FILES = ("config.json", "model.safetensors", TOKENIZER_FILE, "tokenizer_config.json")
"""What an export writes into its folder; those of an earlier export that this one does not write go."""


def export(path: Path, out: Path, data_path: Path | None = None) -> dict:
    """Write ``path``'s model into ``out`` (created; an earlier export's files there replaced or removed).
    ``data_path``: this machine's copy of the run's data, where the file's config names another machine's.
    Returns config.json.

    Raises:
        CheckpointError: not a readable model file, or its params do not match their recorded hash.
        ExportError: not a Llama-shaped model, or its prepared data is not the run's.
    """
    loaded = checkpoint.load(path, data_path)
    cfg = loaded.config
    shape = ZOO[cfg.model.name]
    if not isinstance(shape, LlamaShape):
        raise ExportError(
            f"{path}: model.name {cfg.model.name} has no Hugging Face class; only llama-* models export"
        )
    embedding = loaded.params.get("model.embed_tokens.weight")
    if embedding is None or embedding.dim() != 2:
        raise ExportError(f"{path}: no token embedding (model.embed_tokens.weight) of model {cfg.model.name}")
    if embedding.shape[1] != shape.n_embd:
        raise ExportError(
            f"{path}: model.embed_tokens.weight has shape {list(embedding.shape)}; model {cfg.model.name}'s "
            f"embeddings are {shape.n_embd} wide"
        )
    vocab_size = int(embedding.shape[0])
    if not 0 < vocab_size <= MAX_VOCAB:  # before a model of that size is built
        raise ExportError(
            f"{path}: a vocabulary of {vocab_size} ids (model.embed_tokens.weight) is not a model's"
        )
    # The checks eval makes: every param of this model, of its shape, matching the file's recorded hash.
    checkpoint.load_into(
        build_model(cfg.model.name, cfg.model.context_length, vocab_size=vocab_size), loaded, path
    )
    params = {name: t.contiguous() for name, t in loaded.params.items()}
    manifest = _manifest(cfg.data)
    tokenizer = manifest is not None and manifest.tokenizer == "bpe"
    if tokenizer and loaded.metadata.get("config_hash") not in cfg.resumable_hashes():
        raise ExportError(
            f"{path}: the prepared data at data.path {cfg.data.path} is not what the run trained on (its "
            "config hash differs): its tokenizer would not be the model's; export from where that folder is"
        )
    end_of_text = manifest.end_of_text if manifest is not None else None
    config = {
        **hf_config(cfg.model.name, cfg.model.context_length, vocab_size, end_of_text),
        "p2ptrain": {"run_id": cfg.run.run_id, "round": loaded.round, "params_hash": loaded.params_sha256()},
    }
    try:  # only now: a file that cannot be exported leaves no folder behind
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ExportError(f"{out}: cannot make it ({e.strerror or e})") from None
    # Written beside, then moved in: a failure part-way leaves the earlier export whole, not a mix of two.
    with tempfile.TemporaryDirectory(dir=out, prefix=".export-") as staging_dir:
        staging = Path(staging_dir)
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(params, str(staging / "model.safetensors"), metadata={"format": "pt"})
        if tokenizer:
            assert cfg.data.path is not None
            shutil.copyfile(Path(cfg.data.path) / TOKENIZER_FILE, staging / TOKENIZER_FILE)
            tokenizer_config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                # Only a tokenizer that has it (one of the user's own may not: documents were joined by newlines).
                **({"eos_token": END_OF_TEXT, "bos_token": END_OF_TEXT} if end_of_text is not None else {}),
                "model_max_length": cfg.model.context_length,
            }
            (staging / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        for name in OUTPUT_FILES:
            if (staging / name).exists():
                os.replace(staging / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)
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
