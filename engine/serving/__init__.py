"""Serving: continuous batching over the cycle (`scheduler`) and adaptive speculation (`adaptive`)."""
