"""Validation: loss, perplexity and next-byte accuracy of params on the corpus's held-out end.

Used by the trainer after each round, by ``p2ptrain eval``, by the demo's summary, the benchmarks and the
tests: one definition of "validation loss" everywhere.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from p2ptrain import checkpoint
from p2ptrain.config import ExperimentConfig
from p2ptrain.data import Corpus, open_corpus
from p2ptrain.models import build_model


@torch.no_grad()
def evaluate(model: torch.nn.Module, corpus: Corpus, cfg: ExperimentConfig, device: torch.device) -> dict:
    """Validation loss, perplexity and next-token accuracy over ``data.eval_batches`` fixed batches."""
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in corpus.val_batches(cfg.inner.batch_size, cfg.data.eval_batches):
        x, y = x.to(device), y.to(device)
        logits = model(x).float()
        loss_sum += float(F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        count += y.numel()
    model.train(was_training)
    val_loss = loss_sum / count
    return {
        "val_loss": val_loss,
        "perplexity": math.exp(val_loss),
        "accuracy": correct / count,
        "tokens": count,
    }


class Evaluator:
    """Evaluates model files and initial models, loading each distinct corpus once."""

    def __init__(self) -> None:
        self._corpora: dict[str, Corpus] = {}

    def corpus(self, cfg: ExperimentConfig) -> Corpus:
        key = cfg.data.model_dump_json() + str(cfg.model.context_length)
        if key not in self._corpora:
            self._corpora[key] = open_corpus(cfg.data, cfg.model.context_length, cfg.data.val_fraction)
        return self._corpora[key]

    def initial(self, cfg: ExperimentConfig) -> dict:
        """Metrics of the run's initial model (what every peer starts from)."""
        corpus = self.corpus(cfg)
        model = build_model(
            cfg.model.name, cfg.model.context_length, seed=cfg.run.seed, vocab_size=corpus.vocab_size
        )
        return evaluate(model, corpus, cfg, torch.device("cpu"))

    def loaded(self, loaded: checkpoint.LoadedModel, path: Path | str = "") -> dict:
        """Metrics of a model file's params, under the config stored in it.

        Raises:
            CheckpointError: the params do not fit the model or their hash.
        """
        cfg = loaded.config
        corpus = self.corpus(cfg)
        model = build_model(cfg.model.name, cfg.model.context_length, vocab_size=corpus.vocab_size)
        checkpoint.load_into(model, loaded, path)
        return evaluate(model, corpus, cfg, torch.device("cpu"))

    def file(self, path: Path) -> tuple[checkpoint.LoadedModel, dict]:
        loaded = checkpoint.load(path)
        return loaded, self.loaded(loaded, path)
