"""Built-in model architectures, registered under their Hugging Face names."""
