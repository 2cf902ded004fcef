"""The learned KVpop scorer at serve time: `runtime` runs the exported ONNX step (no torch).

Its network, traces, targets, training and ONNX export live in `kvpop_train.scorer`.
"""

# The learned scorer variants, here and nowhere else: trained by `make train-scorer`, exported as
# scorer_<kind>.onnx beside the decoder, and named by a kvpop request's `scorer` (only kvpop has one).
LEARNED_SCORER_KINDS = ("mlstm", "mlp")


def learned_scorer(kind: str, learned_scorers: dict):
    """The model's loaded scorer of `kind`, or a ValueError that lists what the model has."""
    if kind not in learned_scorers:
        available = sorted(learned_scorers) or "none: export the model after `make train-scorer`"
        raise ValueError(f"no learned kvpop scorer {kind!r} in this model (available: {available})")
    return learned_scorers[kind]
