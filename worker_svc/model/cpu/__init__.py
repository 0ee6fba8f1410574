"""The llama family's CPU fast path: the C kernels and the weight copies they read.

    fused_ops.py      a layer's element-wise ops in C (fp32)
    small_linear.py   the matmul of steps of few tokens, on plain or int8 weight copies
    decode_layers.py  every layer of a small decode step in one C call
    cpu_dtype.py      matmul weights prepacked in oneDNN's layout, bf16 matmuls
"""
