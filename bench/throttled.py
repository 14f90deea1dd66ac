"""``python -m bench.throttled CGROUP ARGS...``: ``p2ptrain ARGS...`` confined to a cgroup (v1 ``cpu``) from its
first instruction, children included: a slow device on a fast machine (``bench/heterogeneous.py``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> None:
    cgroup, *args = sys.argv[1:]
    (Path(cgroup) / "cgroup.procs").write_text(f"{os.getpid()}\n")  # forked children inherit it
    sys.argv = ["p2ptrain", *args]
    from p2ptrain.cli import main as p2ptrain

    p2ptrain()


if __name__ == "__main__":
    main()
