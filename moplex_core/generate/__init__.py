"""Response generators for the augment stage (paper section 4.1; DESIGN.md 2, 8).

    base          the Generator protocol, requests and samples, seeds, text normalisation
    hf            transformers `generate` in this process: batched, seeded per sample
    vllm_backend  vLLM in a subprocess under another interpreter, Parquet shards in and out
    vllm_worker   the stand-alone script that subprocess runs
    borrow        other rankings' responses to the same prompt (no model)

Nothing here imports Prefect or vLLM at module level (the model backends import moplex_core.lm:
torch, transformers, peft, safetensors, huggingface_hub), so the package runs on GPU machines that
have neither.
"""
