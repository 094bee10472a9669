"""Shared fixtures: tiny random checkpoints (made with transformers, no network) and the HF oracle."""
from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run under Triton's CPU interpreter. It is chosen when a kernel module is
# imported, so it is set before any test imports one (and spawned ranks inherit it).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from models.tiny import ARCHS, make_tiny_checkpoint

FULL = pytest.mark.full   # the wider matrix: `make test-full` (pytest --full); CI's `make test` runs the rest


def wider(*values):
    """A parametrize case that only the wider matrix runs."""
    return pytest.param(*values, marks=FULL)


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the wider matrix of topologies, architectures and modes (make test-full)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="the wider matrix: run with `make test-full` (pytest --full)")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch, **overrides) -> directory; cached per (arch, overrides)."""
    made: dict = {}

    def make(arch: str, **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in made:
            path = tmp_path_factory.mktemp(arch)
            made[key] = make_tiny_checkpoint(arch, path, **overrides)
        return made[key]

    return make


def hf_model(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt (one at a time: no padding effects)."""
    model = hf_model(path)
    # No EOS: the runtime side uses ignore_eos. (min_new_tokens would instead mask EOS logits.)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            seq = model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=0)
            assert seq.shape[1] == len(p) + max_new_tokens
            outs.append(seq[0, len(p):].tolist())
    return outs


def make_prompts(n: int, vocab: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (L,), generator=g).tolist() for L in lens]


__all__ = ["ARCHS", "FULL", "hf_greedy", "hf_model", "make_prompts", "wider"]
