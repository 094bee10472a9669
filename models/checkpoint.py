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

    def __init__(self, path: str | os.PathLike, mtp: bool = False, generation_config: str = "auto"):
        """mtp: run the checkpoint's multi-token-prediction layers too (ModelSpec.with_mtp); generation_config:
        where the EOS ids come from (load_spec's)."""
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise ValueError(f"model directory {self.path!r} does not exist; pass a local HF checkpoint directory")
        self.spec = load_spec(self.path, generation_config)
        if mtp:
            self.spec = self.spec.with_mtp()
        self.name2file = self._index()
        for i in range(self.spec.num_layers, self.spec.num_layers + self.spec.num_mtp_layers):
            if f"model.layers.{i}.eh_proj.weight" not in self.name2file:
                raise ValueError(f"config.num_nextn_predict_layers={self.spec.num_mtp_layers} but {self.path!r} has no "
                                 f"multi-token-prediction layer {i} (no 'model.layers.{i}.eh_proj.weight'): use a "
                                 f"checkpoint that ships its MTP layers, or speculative method 'ngram'")
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
             desc: str = "", progress=None) -> dict[str, torch.Tensor]:
        """Read exactly these tensors, one shard open at a time, logging each shard. A block-scaled FP8 weight
        is read with its `weight_scale_inv` and dequantized to dtype. Tensors kept in fp32 by transformers
        (the router's score-correction bias) stay fp32. progress: a stream to draw a tqdm bar of bytes read
        on (the first rank of each role passes stderr), or None."""
        from safetensors import safe_open

        by_file: dict[str, list[str]] = defaultdict(list)
        for n in names:
            if n not in self.name2file:
                raise ValueError(f"tensor {n!r} is missing from checkpoint {self.path!r}")
            by_file[self.name2file[n]].append(n)
            scale = _scale_name(n)
            if scale in self.name2file:
                by_file[self.name2file[scale]].append(scale)
        raw: dict[str, torch.Tensor] = {}
        bar = _progress_bar(self, by_file, desc, progress)
        try:
            for i, (fname, group) in enumerate(sorted(by_file.items()), 1):
                full = os.path.join(self.path, fname)
                try:
                    with safe_open(full, framework="pt", device="cpu") as f:
                        for n in group:
                            raw[n] = f.get_tensor(n)
                            if bar is not None:
                                bar.update(raw[n].nbytes)
                except Exception as e:
                    raise ValueError(f"reading {len(group)} tensors from shard {full!r} failed: {e}") from e
                self.names_read.extend(group)
                logger.info("%s loaded shard %d/%d (%s): %d tensors", desc, i, len(by_file), fname, len(group))
        finally:
            if bar is not None:
                bar.close()
        out = {}
        for n in names:
            t = raw[n]
            if _scale_name(n) in raw:
                t = dequantize_fp8_blocks(t, raw[_scale_name(n)], self.spec.weight_block_size, n)
            keep = torch.float32 if n.endswith(FP32_SUFFIXES) else dtype
            out[n] = t.to(device=device, dtype=keep or t.dtype)
        return out

    def read_rows(self, name: str, rows: list[int], dtype: torch.dtype | None = None,
                  device: str | torch.device = "cpu") -> torch.Tensor:
        """Rows `rows` of tensor `name` along its first dim -> `[len(rows), ...]`, reading only those rows' bytes
        (GPT-OSS stores all of a layer's experts in one tensor; an expert rank reads its own). Records each as
        `name[row]` in names_read."""
        from safetensors import safe_open

        if name not in self.name2file:
            raise ValueError(f"tensor {name!r} is missing from checkpoint {self.path!r}")
        if not rows:
            raise ValueError(f"no rows of {name!r} asked for")
        full = os.path.join(self.path, self.name2file[name])
        with safe_open(full, framework="pt", device="cpu") as f:
            sl = f.get_slice(name)
            num = sl.get_shape()[0]
            bad = [r for r in rows if not 0 <= r < num]
            if bad:
                raise ValueError(f"row {bad[0]} of {name!r} does not exist: it has {num} rows")
            out = torch.stack([sl[r:r + 1][0] for r in rows])
        self.names_read.extend(f"{name}[{r}]" for r in rows)
        return out.to(device=device, dtype=dtype or out.dtype) if out.is_floating_point() else out.to(device)

    def attention_tensor_names(self) -> list[str]:
        """Everything but the routed experts: embeddings, attention, norms, router, shared expert, LM head.
        FP8 scales are read with their weights; MTP layers (beyond num_hidden_layers) only when the spec runs them."""
        last = self.spec.num_layers + self.spec.num_mtp_layers
        skipped = [n for n in self.name2file if _layer_of(n) is not None and _layer_of(n) >= last]
        if skipped:
            logger.info("skipping %d tensors of %d multi-token-prediction layer(s) (layers >= %d): the runtime "
                        "decodes one token per step", len(skipped), self.spec.num_skipped_layers or 1,
                        self.spec.num_layers)
        drop = set(skipped)
        return [n for n in self.name2file
                if not self.spec.is_expert_tensor(n) and not n.endswith(SCALE_SUFFIX) and n not in drop]


SCALE_SUFFIX = "_scale_inv"
FP32_SUFFIXES = ("e_score_correction_bias",)


def load_tokenizer(path: str, chat_template: str | None = None):
    """The checkpoint directory's tokenizer (transformers' AutoTokenizer), or None when it holds none.
    chat_template: the engine's option (read_chat_template's forms), in place of the checkpoint's template."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        if chat_template is not None:
            raise ValueError(f"chat_template={str(chat_template)[:60]!r}: {path!r} has no tokenizer to render it "
                             f"with")
        return None
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ValueError(f"the tokenizer in {path!r} could not be loaded: {e}") from e
    if chat_template is not None:
        tok.chat_template = read_chat_template(chat_template)
    return tok


def read_chat_template(value: str | os.PathLike, name: str = "chat_template") -> str:
    """vLLM's --chat-template rule: a file's path (its text), or the template itself, as it is; a value with no
    brace or newline that names no readable file is a path that failed (vLLM would also look in its own folder of
    templates, which this engine does not ship). The text must compile as a Jinja template (transformers'
    compiler). A ValueError names `name` and what is wrong."""
    is_path = isinstance(value, os.PathLike)
    value = os.fspath(value) if is_path else value
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name}={value!r} is invalid: pass a Jinja template or the path of a file holding one")
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        if is_path or not any(c in value for c in "{}\n"):
            raise ValueError(f"{name}={value!r} looks like a file path, but it cannot be read: {e}") from e
        text = value
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:     # another transformers: the template compiles when it is first used
        return text
    try:
        _compile_jinja_template(text)
    except Exception as e:
        raise ValueError(f"{name}={value[:60]!r} is not a Jinja template that compiles: {e}") from e
    return text


def _scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def _layer_of(name: str) -> int | None:
    if not name.startswith("model.layers."):
        return None
    head = name[len("model.layers."):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
                          name: str = "") -> torch.Tensor:
    """A block-scaled FP8 weight `[out, in]` (e4m3) and its `weight_scale_inv` `[ceil(out/br), ceil(in/bc)]`
    -> the fp32 weight: every (br x bc) block times its scale, as DeepSeek-V3's checkpoints define it."""
    if block is None:
        raise ValueError(f"{name!r} has a weight_scale_inv but config.json has no FP8 quantization_config with "
                         f"weight_block_size")
    br, bc = block
    rows, cols = w.shape
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name!r}: weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a "
                         f"{rows}x{cols} weight in {br}x{bc} blocks")
    s = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return w.float() * s


# The 16 values an FP4 (e2m1) code stands for, by code.
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as GPT-OSS's release stores it: blocks `[..., R, G, 16]` uint8 (two FP4 codes per byte, the low
    nibble first), scales `[..., R, G]` uint8 (a power of two, biased by 127, per 32 values) -> fp32
    `[..., G * 32, R]`: the layout transformers' unquantized GPT-OSS experts use."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} / scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not match: want uint8 [..., R, G, 16] and uint8 [..., R, G]")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)   # [..., R, G, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.float() - 127)[..., None]              # [..., R, G, 32]
    return values.flatten(-2).transpose(-1, -2)


def _progress_bar(ckpt: Checkpoint, by_file: dict[str, list[str]], desc: str, stream):
    """A tqdm bar over the bytes these tensors take (from the shard headers), or None."""
    if stream is None:
        return None
    from safetensors import safe_open
    from tqdm import tqdm

    total = 0
    for fname, group in by_file.items():
        with safe_open(os.path.join(ckpt.path, fname), framework="pt") as f:
            for n in group:
                sl = f.get_slice(n)
                total += _numel(sl.get_shape()) * _dtype_bytes(sl.get_dtype())
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"loading weights {desc}".strip(), file=stream,
                mininterval=0.5)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


_SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                      "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def _dtype_bytes(name: str) -> int:
    return _SAFETENSORS_BYTES.get(name, 1)


def load_spec(path: str, generation_config: str = "auto") -> ModelSpec:
    """config.json (+ generation_config.json) -> ModelSpec, via transformers' own config classes. generation_config:
    the engine option (auto or vllm: the checkpoint's generation_config.json; else a directory holding one, whose
    EOS ids are the engine's, as vLLM reads them from where its --generation-config points)."""
    from transformers import AutoConfig, GenerationConfig

    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{cfg_path!r} is missing; pass a HF checkpoint directory with a config.json")
    try:
        with open(cfg_path) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError) as e:
        raise ValueError(f"{cfg_path!r} is not valid JSON: {e}") from e
    from .spec import SUPPORTED, unsupported_message
    if model_type not in SUPPORTED:
        raise ValueError(unsupported_message(model_type, f" in {cfg_path!r}"))
    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ValueError(f"transformers could not parse {cfg_path!r}: {e}") from e
    gen_cfg = None
    gen_dir = path if generation_config in ("auto", "vllm") else generation_config
    if os.path.exists(os.path.join(gen_dir, "generation_config.json")):
        try:
            gen_cfg = GenerationConfig.from_pretrained(gen_dir, local_files_only=True)
        except Exception as e:
            raise ValueError(f"generation_config.json in {gen_dir!r} is unreadable: {e}") from e
    return spec_from_hf_config(cfg, gen_cfg)
