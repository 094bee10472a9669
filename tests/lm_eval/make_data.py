"""Build the two tiny offline lm-eval datasets from the shipped model's held-out play (The Tempest); run once,
the JSONL files are committed (bench/lm_eval_compare.py reads them).

shakespeare_mc.jsonl  : {"context", "choices"[4], "label"}  (next-word multiple choice)
shakespeare_gen.jsonl : {"context", "target"}               (next speaker name, generate_until)
"""
import json
import random
import re
import sys
from pathlib import Path

SHIPPED_TEXT = Path(__file__).resolve().parents[2] / "models/shakespeare-moe/heldout.txt"
src = Path(sys.argv[1]) if len(sys.argv) > 1 else SHIPPED_TEXT
out = Path(__file__).resolve().parent
lines = src.read_text().splitlines()
rng = random.Random(0)

# --- multiple choice: last word of a verse line -------------------------------
verse = [i for i, l in enumerate(lines)
         if i > 400 and re.fullmatch(r"[A-Za-z][A-Za-z ,';:!?.-]{25,70}", l)
         and re.search(r" [a-z]{3,}[,.;:!?]?$", l)]
vocab = sorted({re.sub(r"[^a-z]", "", l.split()[-1]) for l in (lines[i] for i in verse)} - {""})
mc = []
for i in rng.sample(verse, 24):
    words = lines[i].split(" ")
    last = re.sub(r"[^a-z]", "", words[-1])
    prefix = "\n".join(lines[i - 3:i]) + "\n" + " ".join(words[:-1])
    distract = rng.sample([w for w in vocab if w != last], 3)
    choices = distract + [last]
    rng.shuffle(choices)
    mc.append({"context": prefix, "choices": choices, "label": choices.index(last)})

# --- generate_until: who speaks next ----------------------------------------
spk = [i for i, l in enumerate(lines)
       if re.fullmatch(r"[A-Z][A-Z ]+\.", l) and i > 400 and lines[i - 1] == "" and lines[i - 2] != ""]
gen = []
for i in rng.sample(spk, 24):
    ctx = "\n".join(lines[max(0, i - 8):i]) + "\n"
    gen.append({"context": ctx, "target": lines[i].rstrip(".")})

for name, rows in [("shakespeare_mc.jsonl", mc), ("shakespeare_gen.jsonl", gen)]:
    with open(out / name, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(name, len(rows))
