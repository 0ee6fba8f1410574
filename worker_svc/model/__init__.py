"""Our own decoder implementation (Llama family and Qwen2) over the paged KV cache."""
