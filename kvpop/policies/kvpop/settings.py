"""A deployment's kvpop settings: what every kvpop request of a served model gets.

Read from the engine model's config.pbtxt parameters kvpop_scorer, kvpop_query_window and
kvpop_span_pooling (docs/CONFIGURATION.md) by the policy registry (`kvpop.policies.registry.policy_settings`),
checked when the model loads, and turned into the options of every kvpop request once the model's learned
scorers are known (`options`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpop.policies.kvpop.kinds import LEARNED_SCORER_KINDS, default_scorer
from kvpop.policies.kvpop.scorers import SCORERS
from kvpop.policies.kvpop.text_spans import SPAN_POOLINGS

PARAMETER = "kvpop_{}"  # the config.pbtxt name of a setting


@dataclass(frozen=True)
class KVpopSettings:
    scorer: str = "auto"  # auto (learned mLSTM when exported), mlstm, mlp, accumulated_attention
    # > 0: a prompt that enters whole lets its last this many tokens (the question) pick half of kvpop's long-range
    # slots by their attention (kvpop.policies.kvpop.query); 0: off; auto: 32 when the learned scorer's model ships
    # retrieval heads (retrieval_heads.json), else off
    query_window: str = "auto"
    # how kvpop ranks prompt tokens by span: auto (sentence_contrast when the question picks, else as the scorer was
    # trained), line_contrast, sentence_contrast, ...
    span_pooling: str = "auto"

    def __post_init__(self) -> None:
        scorers = ["auto", *LEARNED_SCORER_KINDS, *SCORERS]
        if self.scorer not in scorers:
            raise ValueError(f"parameter {PARAMETER.format('scorer')} {self.scorer!r} is not one of {scorers}")
        if self.query_window != "auto" and not self.query_window.isdigit():  # digits only: an integer >= 0
            raise ValueError(f"parameter {PARAMETER.format('query_window')} must be auto or an integer >= 0, "
                             f"got {self.query_window!r}")
        if self.span_pooling != "auto" and self.span_pooling not in SPAN_POOLINGS:
            raise ValueError(f"parameter {PARAMETER.format('span_pooling')} {self.span_pooling!r} is not auto or one of "
                             f"{SPAN_POOLINGS}")

    def options(self, learned_scorers: dict | None) -> dict[str, Any]:
        """The options of every kvpop request on a model with these learned scorers: the scorer (auto: the
        mLSTM when the model has one), query_window, and span_pooling, which only a learned scorer has; an
        `auto` setting leaves its option to the policy's default. ValueError: a learned scorer the model lacks."""
        try:
            scorer = default_scorer(self.scorer, learned_scorers or {})
        except ValueError as error:
            raise ValueError(f"parameter {PARAMETER.format('scorer')}: {error}") from None
        spans = self.span_pooling != "auto" and scorer in LEARNED_SCORER_KINDS
        return {"scorer": scorer,
                **({"query_window": int(self.query_window)} if self.query_window != "auto" else {}),
                **({"span_pooling": self.span_pooling} if spans else {})}
