"""The kvpop method's names: its ranking statistic and the learned scorer kinds a request may name."""

SCORE = "kvpop_score"  # the per-slot statistic the kvpop policy ranks by

# The learned scorer variants, here and nowhere else: trained by `make train-scorer`, exported as
# scorer_<kind>.onnx beside the decoder, and named by a kvpop request's `scorer` (only kvpop has one).
LEARNED_SCORER_KINDS = ("mlstm", "mlp")


def learned_scorer(kind: str, learned_scorers: dict):
    """The model's loaded scorer of `kind`, or a ValueError that lists what the model has."""
    if kind not in learned_scorers:
        available = sorted(learned_scorers) or "none: export the model after `make train-scorer`"
        raise ValueError(f"no learned kvpop scorer {kind!r} in this model (available: {available})")
    return learned_scorers[kind]


def default_scorer(setting: str, learned_scorers: dict) -> str:
    """The scorer a service's kvpop requests use: "auto" is the mLSTM when the model has one, else the
    attention stand-in; a learned kind must be loaded (ValueError otherwise)."""
    if setting == "auto":
        return "mlstm" if "mlstm" in learned_scorers else "accumulated_attention"
    if setting in LEARNED_SCORER_KINDS:
        learned_scorer(setting, learned_scorers)
    return setting


def load_learned_scorers(model_dir) -> dict:
    """The KVpop scorers exported beside the decoder (`scorer_<kind>.onnx`), by kind."""
    from kvpop.policies.kvpop.runtime import LearnedScorer, ScorerRuntime

    return {kind: LearnedScorer.load(model_dir, kind) for kind in ScorerRuntime.available(model_dir)}


def requested_learned_scorer(cache) -> "str | None":
    """The learned scorer kind a cache configuration (kvpop.request.CacheConfig) needs loaded, or None."""
    scorer = getattr(cache.options, "scorer", None) if cache.policy == "kvpop" else None
    return scorer if scorer in LEARNED_SCORER_KINDS else None
