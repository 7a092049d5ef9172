"""rltrain's embedded engine: a transformers model behind SGLang's native HTTP API."""
