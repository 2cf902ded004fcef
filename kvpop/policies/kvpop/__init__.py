"""The KVpop method in one package: the policy (`policy`), its pluggable scorers (`scorers`), the learned
scorer's ONNX runtime (`runtime`), line pooling of prompt scores (`text_spans`), the vectorised decode
append (`decode_batch`) and the scorer state's codec for sessions (`state_codec`). The rest of the
runtime reaches it only through the generic `EvictionPolicy` hooks and the registry in kvpop.policies.
"""

from kvpop.policies.kvpop.kinds import LEARNED_SCORER_KINDS, SCORE, default_scorer, learned_scorer, load_learned_scorers
from kvpop.policies.kvpop.policy import KVpopPolicy

__all__ = ["LEARNED_SCORER_KINDS", "SCORE", "KVpopPolicy", "default_scorer", "learned_scorer", "load_learned_scorers"]
