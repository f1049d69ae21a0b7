"""Loading a checkpoint: config.json into ModelConfig, a folder's or a GGUF's weights and
tokenizer (a GGUF converted into a Hugging Face folder once, cached)."""
