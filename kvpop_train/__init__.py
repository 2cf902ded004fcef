"""Training, kept out of the served package: the Triton models import `kvpop` only.

  - `kvpop_train.reference`: the reference model (tokenizer, curriculum, trainer) on `kvpop_tasks`.
  - `kvpop_train.scorer`: the learned KVpop scorer's network (torch), training traces and targets and
    training loop. `export.scorer_onnx` exports it; at serve time `kvpop.policies.kvpop.runtime` runs the ONNX.

Imports go one way: kvpop_tasks <- kvpop_train <- export <- kvpop_eval (tests/test_import_graph.py).
"""
