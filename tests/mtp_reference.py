"""A reference forward of DeepSeek-V3's multi-token-prediction layer, written from its definition (DeepSeek-V3
report, section 2.2) on transformers' own modules: the oracle of the MTP tests (transformers does not implement
MTP)."""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.conftest import hf_model


class ReferenceMTP:
    """The MTP layer from its definition, on transformers' modules: the target's final-normed hidden states h_p
    (transformers' model.norm output), then per position p < n - 1
        y_p = Layer(eh_proj([enorm(embed(t_{p+1})); hnorm(h_p)])),   draft = argmax(head(norm(y_p)))
    where Layer, norm and head are transformers' DeepSeek-V3 decoder layer, RMSNorm and linear loaded with the
    MTP layer's weights (a one-layer model whose layer 0 is the MTP layer's, norm its shared_head.norm, lm_head its
    shared_head.head). Draft j > 1 appends a position whose hidden input is the previous position's y."""

    def __init__(self, path: str, tmp: str):
        cfg = json.load(open(os.path.join(path, "config.json")))
        L = cfg["num_hidden_layers"]
        w = load_file(os.path.join(path, "model.safetensors"))
        p = f"model.layers.{L}."
        self.enorm, self.hnorm, self.eh_proj = w[p + "enorm.weight"], w[p + "hnorm.weight"], w[p + "eh_proj.weight"]
        self.embed, self.eps = w[p + "embed_tokens.weight"], cfg["rms_norm_eps"]
        own = {"model.layers.0." + n[len(p):]: t for n, t in w.items() if n.startswith(p)
               and not n[len(p):].startswith(("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens"))}
        own.update({"model.norm.weight": w[p + "shared_head.norm.weight"], "lm_head.weight":
                    w[p + "shared_head.head.weight"], "model.embed_tokens.weight": w["model.embed_tokens.weight"]})
        os.makedirs(tmp, exist_ok=True)
        save_file(own, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        json.dump(dict(cfg, num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0),
                  open(os.path.join(tmp, "config.json"), "w"))
        self.target, self.layer = hf_model(path), hf_model(tmp)
        outs = {}
        self.target.model.norm.register_forward_hook(lambda m, i, o: outs.__setitem__("h", o))
        self.layer.model.layers[0].register_forward_hook(lambda m, i, o: outs.__setitem__("y", o))
        self.outs = outs

    def _norm(self, x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    @torch.no_grad()
    def drafts(self, tokens: list[int], room: int) -> list[int]:
        """The MTP drafts after `tokens` (n of them): the target's hidden states at 0..n-2, then room passes."""
        n = len(tokens)
        self.target(torch.tensor([tokens[:n - 1]]))
        hidden = self.outs["h"][0]                                           # [n-1, H]
        nxt, out = list(tokens[1:]), []
        for _ in range(room):
            x = torch.cat((self._norm(F.embedding(torch.tensor(nxt), self.embed), self.enorm),
                           self._norm(hidden, self.hnorm)), dim=-1) @ self.eh_proj.T
            logits = self.layer(inputs_embeds=x[None], position_ids=torch.arange(len(nxt))[None]).logits[0, -1]
            out.append(int(logits.argmax()))
            nxt.append(out[-1])
            hidden = torch.cat((hidden, self.outs["y"][0, -1:]))
        return out
