"""The KVpop method in one package: the policy (`policy`), its pluggable scorers (`scorers`), the learned
scorer's ONNX runtime (`runtime`), line pooling of prompt scores (`text_spans`), the vectorised decode
append (`decode_batch`), the scorer state's codec for sessions (`state_codec`) and a deployment's kvpop
settings (`settings`). The rest of the runtime reaches it only through the generic `EvictionPolicy` hooks
and the registry in kvpop.policies.
"""

from kvpop.policies.kvpop.kinds import LEARNED_SCORER_KINDS, SCORE, default_scorer, learned_scorer, load_learned_scorers
from kvpop.policies.kvpop.policy import KVpopPolicy
from kvpop.policies.kvpop.scorers import SCORERS, AccumulatedAttentionScorer, LeavingTokens, TokenScorer
from kvpop.policies.kvpop.settings import KVpopSettings

__all__ = [
    "LEARNED_SCORER_KINDS", "SCORE", "SCORERS", "AccumulatedAttentionScorer", "KVpopPolicy", "KVpopSettings", "LeavingTokens",
    "TokenScorer", "default_scorer", "learned_scorer", "load_learned_scorers",
]
