"""On-disk tensor formats shared by the engines, the runtime and convert (the bottom of the stack).

``hf_writer``: the one atomic, streaming Hugging Face safetensors writer. ``megatron_layout``: how HF
tensors map onto megatron-core's GPTModel (fused QKV, gate/up, TP/PP slices).
"""
