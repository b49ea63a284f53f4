"""The OpenAI-compatible surface: /v1/chat/completions and /v1/models."""
