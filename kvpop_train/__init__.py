"""Training, kept out of the served package: the Triton models import `kvpop` only.

  - `kvpop_train.reference`: the reference model (tokenizer, curriculum, trainer, evaluation).
  - `kvpop_train.scorer`: the learned KVpop scorer's network (torch), training traces and targets,
    training loop and ONNX export. At serve time `kvpop.policies.kvpop.runtime` runs the exported ONNX.
"""
