"""The learned KVpop scorer: targets, network, traces and training (torch), ONNX export and runtime.

Only `runtime` is needed at serve time and imports no torch; import the modules directly.
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
