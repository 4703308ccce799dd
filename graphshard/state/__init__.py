"""Model state on disk: sharded checkpoints (DCP), full checkpoints and Hugging Face
safetensors loaded into a sharded model.
"""
