"""Our top-level `kernels` package must not confuse transformers' probe for the hub `kernels` package."""
from __future__ import annotations

import torch


def test_transformers_loads_with_project_installed(tiny_checkpoint):
    from transformers import AutoModelForCausalLM
    from transformers.utils.import_utils import is_kernels_available

    import kernels

    assert hasattr(kernels, "__path__") and not is_kernels_available()
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("mixtral"))
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 320)
