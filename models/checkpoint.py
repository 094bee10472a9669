"""Read a local Hugging Face checkpoint directory, tensor by tensor.

A rank asks only for the tensors it owns; `Checkpoint.names_read` records them so tests
can assert that no rank ever read the whole model.
"""
from __future__ import annotations

import json
import logging
import os
from collections import defaultdict

import torch

from .spec import ModelSpec, spec_from_hf_config

logger = logging.getLogger(__name__)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class Checkpoint:
    """A checkpoint directory: config.json, model.safetensors or an index with shards, optional tokenizer."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise ValueError(f"model directory {self.path!r} does not exist; pass a local HF checkpoint directory")
        self.spec = load_spec(self.path)
        self.name2file = self._index()
        self.names_read: list[str] = []

    def _index(self) -> dict[str, str]:
        """Map every tensor name to its shard file, checking each shard's header."""
        from safetensors import safe_open

        index_path = os.path.join(self.path, INDEX)
        if os.path.exists(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as e:
                raise ValueError(f"checkpoint index {index_path!r} is unreadable or corrupt: {e}") from e
            files = sorted(set(weight_map.values()))
        elif os.path.exists(os.path.join(self.path, SINGLE)):
            weight_map, files = None, [SINGLE]
        else:
            raise ValueError(f"no {SINGLE} or {INDEX} in {self.path!r}; the directory holds no safetensors weights")
        name2file: dict[str, str] = {}
        for fname in files:
            full = os.path.join(self.path, fname)
            if not os.path.exists(full):
                raise ValueError(f"checkpoint shard {full!r} is missing (named by {INDEX})")
            try:
                with safe_open(full, framework="pt") as f:
                    keys = list(f.keys())
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise ValueError(f"checkpoint shard {full!r} is corrupt or not safetensors: {e}") from e
            for k in keys:
                name2file[k] = fname
        if weight_map is not None:
            missing = [n for n, fname in weight_map.items() if name2file.get(n) != fname]
            if missing:
                raise ValueError(f"{INDEX} names {len(missing)} tensors not found in their shards, e.g. {missing[0]!r}")
        return name2file

    def has(self, name: str) -> bool:
        return name in self.name2file

    def read(self, names: list[str], dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
             desc: str = "") -> dict[str, torch.Tensor]:
        """Read exactly these tensors, one shard open at a time. Logs progress per shard."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = defaultdict(list)
        for n in names:
            if n not in self.name2file:
                raise ValueError(f"tensor {n!r} is missing from checkpoint {self.path!r}")
            by_file[self.name2file[n]].append(n)
        out: dict[str, torch.Tensor] = {}
        for i, (fname, group) in enumerate(sorted(by_file.items()), 1):
            full = os.path.join(self.path, fname)
            try:
                with safe_open(full, framework="pt", device="cpu") as f:
                    for n in group:
                        t = f.get_tensor(n)
                        out[n] = t.to(device=device, dtype=dtype or t.dtype)
            except Exception as e:
                raise ValueError(f"reading {len(group)} tensors from shard {full!r} failed: {e}") from e
            self.names_read.extend(group)
            logger.info("%s loaded shard %d/%d (%s): %d tensors", desc, i, len(by_file), fname, len(group))
        return out

    def attention_tensor_names(self) -> list[str]:
        """Everything but the routed experts: embeddings, attention, norms, router, shared expert, LM head."""
        return [n for n in self.name2file if not self.spec.is_expert_tensor(n)]


def load_spec(path: str) -> ModelSpec:
    """config.json (+ generation_config.json) -> ModelSpec, via transformers' own config classes."""
    from transformers import AutoConfig, GenerationConfig

    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{cfg_path!r} is missing; pass a HF checkpoint directory with a config.json")
    try:
        with open(cfg_path) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError) as e:
        raise ValueError(f"{cfg_path!r} is not valid JSON: {e}") from e
    from .spec import SUPPORTED
    if model_type not in SUPPORTED:
        raise ValueError(f"model_type {model_type!r} in {cfg_path!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED)}")
    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ValueError(f"transformers could not parse {cfg_path!r}: {e}") from e
    gen_cfg = None
    if os.path.exists(os.path.join(path, "generation_config.json")):
        try:
            gen_cfg = GenerationConfig.from_pretrained(path, local_files_only=True)
        except Exception as e:
            raise ValueError(f"generation_config.json in {path!r} is unreadable: {e}") from e
    return spec_from_hf_config(cfg, gen_cfg)
