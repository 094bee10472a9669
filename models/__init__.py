"""Checkpoint reading, model specs, tiny random checkpoints for tests, and the shipped trained model."""
import os

# A small Qwen3-MoE trained on Shakespeare by scripts/train_tiny_moe.py (8 experts, top-2): the default model of
# `make demo`, `launch/serve.py` and the benches.
SHIPPED_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shakespeare-moe")
