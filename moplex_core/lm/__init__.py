"""The language-model path: loading, tokenisation, chunked response log-probs, a tiny offline model.

    loading   load_model / load_tokenizer from a local directory or a cached hub name
    tokenize  prompt + response token ids with a shared prompt prefix; right-padded batches
    logprobs  log pi(y|x) at response positions only, chunked over the vocabulary projection
    tiny      build_tiny_model: a small Qwen3 chat model made offline for tests and the demo
"""
