"""Quality harness: accuracy of the engine on a JSONL of {"prompt", "answer"} under one policy/budget,
or a sweep of every policy over compression ratios (JSON + markdown table + accuracy plot).

    python -m kvpop_eval.quality --model DIR --tasks FILE.jsonl --policy P (--budget N | --compression R) --out report.json
    python -m kvpop_eval.quality --model DIR --tasks FILE.jsonl --sweep --out-dir DIR [--compressions 0,0.5,0.75,0.88,0.94]
    python -m kvpop_eval.quality --merge DIR1 DIR2 --out-dir DIR
    python -m kvpop_eval.quality --concat DIR1 DIR2 --tasks FILE.jsonl --out-dir DIR

`--merge` joins sweeps of different policies on the same tasks; `--concat` joins sweeps run on
consecutive pieces of one tasks file (shards, or tasks added to a finished run) into one over the file.

A sweep entry is a policy name, or `kvpop:<scorer>` for the kvpop policy with one scorer; by default the
sweep runs every policy (kvpop with its attention-based scorer) plus `kvpop:<kind>` for every learned
scorer exported with the model (stateful `mlstm`, stateless `mlp`), so they are compared side by side.
A single run of `--policy kvpop` uses the service's scorer by default (`auto`: the exported mLSTM when
present, else the attention-based one).

Scoring: `final_answer` (default) is the project tasks' exact match of the word after "#";
`contains` counts an answer found anywhere in the generated text (for arbitrary JSONL; a list answer
needs all of its items).

Answer retention (`python -m kvpop_eval.quality.retention`, kvpop_eval/quality/retention.py): whether each task's answer
survives the prompt's eviction, per policy x compression, without generating (what the eviction kept, apart from
what the model makes of it).

This package's top level imports no engine (tasks_io, report are pure Python); harness runs the engine.
"""

from kvpop_eval.quality.report import concat_sweeps, markdown_table, merge_sweeps, paired_counts, plot_sweep, wilson_interval
from kvpop_eval.quality.tasks_io import SWEEP_COMPRESSIONS, encode, load_tasks, scorer

__all__ = ["SWEEP_COMPRESSIONS", "concat_sweeps", "encode", "load_tasks", "markdown_table", "merge_sweeps", "paired_counts",
           "plot_sweep", "scorer", "wilson_interval"]
