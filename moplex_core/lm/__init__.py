"""The language-model path: loading, tokenisation, chunked response log-probs, a tiny offline model.

    loading      load_model / load_tokenizer from a local directory or a cached hub name
    lean         Qwen2/Qwen3 RMSNorm and MLP that keep fewer bytes for the backward (load_model uses them)
    device       host-to-device copies that do not wait, results copied back in batches
    tokenize     prompt + response token ids with a shared prompt prefix; right-padded batches
    logprobs     log pi(y|x) at response positions only, chunked over the vocabulary projection
    multi_lora   k LoRA adapters on one base model, routed per row, in PEFT's format
    checkpointing  decoder layers that keep their input and run again in the backward (opt-in)
    routed_adam  AdamW's step for the adapters a minibatch routed
    tiny         build_tiny_model: a small Qwen3 chat model made offline for tests and the demo
"""
