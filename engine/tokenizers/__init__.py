"""The engine's tokenizers, all run by the Hugging Face `tokenizers` library: byte-level BPE and SentencePiece
from a GGUF's metadata, a Hugging Face folder's own, and what they share (decoding, streaming, chat templates)."""
