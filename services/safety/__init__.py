"""The safety service: a pre-filter on prompts and a streaming post-filter on generated text.

Map of the package (one main class per file):
  categories    Category, Direction, Tier, and `SafetyVerdict` (the dataclass every layer passes)
  normalize     NFKC, case folding, homoglyph/leetspeak folding, invisible-character removal
  pattern_rules the pattern tier's regex sources per category;  patterns: `PatternTier`;  pii: PII
  features      hashed word + character n-grams;  classifier: `LinearClassifier` (the learned tier)
  policy        `SafetyPolicy` per organisation, `PolicyBook` (default + overrides, JSON/YAML)
  checker       `SafetyChecker`: runs the tiers a policy enables, applies thresholds and action
  stream_filter `OutputStreamFilter`: sliding-window post-filter of one generation
  service/server/main  gRPC servicer, server with health + metrics + drain, CLI entry points
  client        `SafetyClient` for the gateway, with a documented fail mode per direction
  evaluate      `python -m services.safety.evaluate`: precision/recall and latency per tier
Never imports `engine`.
"""
