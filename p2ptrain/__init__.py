"""p2ptrain: train one model together on machines you already own (peer-to-peer DiLoCo over hivemind)."""

__version__ = "0.1.0"
