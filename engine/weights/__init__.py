"""Reading model files: the GGUF reader, and the loaders of GGUF files and Hugging Face folders (config and
tensors, renamed to Hugging Face's names)."""
