"""rltrain: RL post-training for LLMs as one SPMD program under torchrun."""

__version__ = "0.1.0"
