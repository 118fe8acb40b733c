"""Method ``ar``: plain greedy decoding, expressed as a drafter that never drafts.

Verifying a root-only tree is one autoregressive step, so ``ar`` runs through the very same
propose -> verify -> accept -> commit loop as every speculative method: it is the reference they
must all equal token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

from triedec.drafters.base import BaseDrafter, Draft, ModelInfo
from triedec.drafters.registry import NoOptions, register


@register("ar", NoOptions, "greedy autoregressive decoding (the reference; one token per forward)")
class Autoregressive(BaseDrafter):
    drafts_forced = False  # the reference decodes one token a forward, under a grammar too

    def __init__(self, options: NoOptions, model: ModelInfo) -> None:
        del options, model

    def propose(self, context: Sequence[int]) -> Draft:
        return Draft.root_only(context[-1])
