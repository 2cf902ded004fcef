"""Session 16 diagnostic (validation split only): print every needle line of each prompt with the characters
of the tokens the engine's cache held after prefill (others shown as '·'), and the generated answers.

    python docs/quality/real/experiments/kept-set/needles_kept.py --model model_repository/kvpop_engine/1 \
        --tasks build/diag/val-pk12.jsonl --policy kvpop --scorer mlstm --compression 0.75 \
        --scoring contains --max-tokens 32 --window 64 --out build/diag/pk12.json
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

from transformers import AutoTokenizer  # noqa: E402

from kvpop import engine as engine_module  # noqa: E402
from kvpop import eval as evaluation  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay_kept_set import held_after_prefill, recording_accept  # noqa: E402  (positions held after prefill)


if __name__ == "__main__":
    engine_module.Engine._accept = recording_accept
    evaluation.main(sys.argv[1:])
    tokenizer = AutoTokenizer.from_pretrained("models/smollm2-135m-instruct")
    tasks = [json.loads(line) for line in open(sys.argv[sys.argv.index("--tasks") + 1])]
    for (ids, positions), task in zip(held_after_prefill.values(), tasks):
        held = set(positions[0, 0].tolist())  # a shared ranking: every cache holds the same positions
        text, marks = "", ""
        for position, token in enumerate(ids):
            piece = tokenizer.decode([token])
            text, marks = text + piece, marks + ("#" if position in held else "_") * len(piece)
        print("==", task["index"], task["family"], task["answer"])
        for match in re.finditer(r"[^\n]*(magic number|pass key)[^\n]*", text):
            span = slice(match.start(), match.end())
            print("   ", "".join(c if m == "#" else "·" for c, m in zip(text[span], marks[span]))[:150])
    report = json.loads(Path(sys.argv[sys.argv.index("--out") + 1]).read_text())
    for row in report["rows"]:
        print(row["index"], row["correct"], repr(row["generated"][:100]))
