"""Loss plots: a real PNG with one line per peer; `p2ptrain eval --plot` draws checkpoints by round."""

import subprocess
import sys

from p2ptrain import checkpoint
from p2ptrain.config import ExperimentConfig
from p2ptrain.diloco import DiLoCo
from p2ptrain.models import build_model
from p2ptrain.plots import plot_loss

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_loss_writes_a_png(tmp_path):
    path = plot_loss({"peer 0": [(1, 3.0), (2, 2.5)], "peer 1": [(2, 2.4), (1, 3.1)]}, tmp_path / "a/b.png")
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_eval_plot_of_several_checkpoints(tmp_path):
    cfg = ExperimentConfig()
    cfg.model.name, cfg.model.context_length, cfg.data.eval_batches = "gpt-nano", 16, 1
    model = build_model("gpt-nano", 16)
    d = DiLoCo(model, lr=0.7, momentum=0.9, nesterov=True)
    paths = []
    for r in range(3):
        d.sync(None, weight=1, round=r)
        paths.append(tmp_path / f"round-{r:06d}.safetensors")
        checkpoint.save(paths[-1], model, d, cfg, peer_id="12D3KooWexamplePEER")
    out = subprocess.run(
        [sys.executable, "-m", "p2ptrain", "eval", *map(str, paths), "--plot", str(tmp_path / "loss.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip().splitlines()) == 4  # one line per file, then where the plot went
    assert (tmp_path / "loss.png").read_bytes().startswith(PNG_MAGIC)
