"""Reading a checkpoint into the model's weights.

    weights.py            safetensors (single or sharded) -> fused per-layer weights, a
                          rank's slices (CheckpointSlices), read once without mapping
    safetensors_io.py     tensor headers and reads (a GGUF's tensors too)
    gguf_tensors.py       a GGUF file's tensors under our names, dequantized exactly
    checkpoint_checks.py  refusals by name: quantized tensors no method took, non-float
                          weights, shapes the config does not imply
    dummy_weights.py      --load-format dummy: random weights of the checkpoint's shapes

Quantized checkpoints' methods (dequantized as they are read): ../quantization/.
"""
