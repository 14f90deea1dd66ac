"""Validation: loss, perplexity and next-token accuracy of params on the corpus's held-out end, or loss and
accuracy on an image set's validation and test images.

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
from p2ptrain.images import ImageSet
from p2ptrain.models import build_model


def perplexity(loss: float) -> float:
    """exp(loss); inf where that is no float (a blown-up model's loss above about 709), not an error."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, corpus: Corpus | ImageSet, cfg: ExperimentConfig, device: torch.device
) -> dict:
    """Validation loss and accuracy (of the next token, or of the class) over ``data.eval_batches`` fixed
    batches; for text also perplexity, for an image set also the loss and accuracy over every test image
    (``test_loss``, ``test_accuracy``, ``test_images``)."""
    val = _metrics(model, corpus.val_batches(cfg.inner.batch_size, cfg.data.eval_batches), device)
    if isinstance(corpus, ImageSet):
        test = _metrics(model, corpus.test_batches(cfg.inner.batch_size), device)
        return {
            "val_loss": val["loss"],
            "accuracy": val["accuracy"],
            "images": val["count"],
            "test_loss": test["loss"],
            "test_accuracy": test["accuracy"],
            "test_images": test["count"],
        }
    return {
        "val_loss": val["loss"],
        "perplexity": perplexity(val["loss"]),
        "accuracy": val["accuracy"],
        "tokens": val["count"],
    }


def _metrics(model: torch.nn.Module, batches, device: torch.device) -> dict:
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        logits = model(x).float()
        loss_sum += float(F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), reduction="sum"))
        correct += int((logits.argmax(-1) == y).sum())
        count += y.numel()
    model.train(was_training)
    return {"loss": loss_sum / count, "accuracy": correct / count, "count": count}


class Evaluator:
    """Evaluates model files and initial models, loading each distinct corpus once."""

    def __init__(self) -> None:
        self._corpora: dict[str, Corpus | ImageSet] = {}

    def corpus(self, cfg: ExperimentConfig) -> Corpus | ImageSet:
        key = cfg.data.model_dump_json() + str(cfg.model.context_length)
        if key not in self._corpora:
            self._corpora[key] = open_corpus(cfg.data, cfg.model.context_length, cfg.data.val_fraction)
        return self._corpora[key]

    def initial(self, cfg: ExperimentConfig) -> dict:
        """Metrics of the run's initial model (what every peer starts from)."""
        corpus = self.corpus(cfg)
        model = build_model(
            cfg.model.name, cfg.model.context_length, seed=cfg.run.seed, **corpus.model_args()
        )
        return evaluate(model, corpus, cfg, torch.device("cpu"))

    def loaded(self, loaded: checkpoint.LoadedModel, path: Path | str = "") -> dict:
        """Metrics of a model file's params, under the config stored in it.

        Raises:
            CheckpointError: the params do not fit the model or their hash.
        """
        cfg = loaded.config
        corpus = self.corpus(cfg)
        model = build_model(cfg.model.name, cfg.model.context_length, **corpus.model_args())
        checkpoint.load_into(model, loaded, path)
        return evaluate(model, corpus, cfg, torch.device("cpu"))

    def file(self, path: Path, data_path: Path | None = None) -> tuple[checkpoint.LoadedModel, dict]:
        """A model file's metrics, on the data its config names (or on ``data_path``, a copy of it here)."""
        loaded = checkpoint.load(path, data_path)
        return loaded, self.loaded(loaded, path)
