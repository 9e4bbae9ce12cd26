"""The library used from engines that are not its own: adapters that implement the ports (`core.ports`) over
another framework's models. `integrations.transformers`: any Hugging Face transformers causal LM."""
