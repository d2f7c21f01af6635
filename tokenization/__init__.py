"""A model's text interface, shared by the gateway and the engine and free of torch.

- `tokenizer.Tokenizer`: text <-> token ids (the Rust `tokenizers` BPE) and chat messages -> prompt;
- `chat_template.ChatTemplate`: the model's jinja2 chat template, rendered in a sandbox as
  `transformers` renders it;
- `gguf_vocab`: the tokenizer a GGUF file describes, rebuilt with `tokenizers` components;
- `block_hashes`: the chained 64-bit hashes of full token blocks that name a prompt prefix (the engine's
  prefix cache registers them, the gateway sends them to the scheduler to route by prefix);
- `finish_reason.FinishReason`: why a choice ended, from the engine's step to the API;
- `kv_blocks`: where a KV block lives (`KVTier`) and what happened to it (`KVEvent`), from the engine's
  block manager to the scheduler's prefix index;
- `errors`: what the above raise on purpose.

The ground floor: nothing here imports engine/, kvtransfer/, scheduler/ or services/ (an import-linter
contract in pyproject.toml, `tests/unit/tokenization/test_layering.py`), nor torch.
"""
