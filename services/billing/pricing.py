"""`PriceTable`: USD per 1,000 tokens per model, split into input, cached input and output.

The cost is computed once, when the consumer records the event, and stored with the row: a later
price change never rewrites past bills. Models without their own entry use the "*" price.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal

from services.billing.events import UsageEvent
from services.common.errors import ConfigError
from services.common.settings import BatonSettings

_THOUSAND = Decimal(1000)
_QUANTUM = Decimal("0.00000001")  # numeric(18, 8) in usage_events.cost_usd


@dataclass(frozen=True)
class ModelPrice:
    input: Decimal  # per 1K uncached prompt tokens
    cached_input: Decimal  # per 1K cached prompt tokens
    output: Decimal  # per 1K completion tokens

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> Decimal:
        uncached = prompt_tokens - cached_tokens
        total = (uncached * self.input + cached_tokens * self.cached_input
                 + completion_tokens * self.output) / _THOUSAND
        return total.quantize(_QUANTUM)


@dataclass(frozen=True)
class PriceTable:
    prices: Mapping[str, ModelPrice]
    fallback: ModelPrice

    @classmethod
    def from_settings(cls, settings: BatonSettings) -> PriceTable:
        prices = {model: ModelPrice(p.input, p.cached_input, p.output)
                  for model, p in settings.pricing.items()}
        if "*" not in prices:
            raise ConfigError('BATON_PRICING needs a "*" entry')
        return cls(prices, prices["*"])

    def price_for(self, model: str) -> ModelPrice:
        return self.prices.get(model, self.fallback)

    def cost(self, event: UsageEvent) -> Decimal:
        return self.price_for(event.model).cost(event.prompt_tokens, event.cached_tokens,
                                                event.completion_tokens)
