"""Shared by every API surface: the app factory, errors, middleware, settings, auth and keys,
the chat template, sampling, streaming, usage, and running the server."""
