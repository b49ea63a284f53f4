"""The session API: /v1/sessions (routes, its WebSocket), its request and response models and the
bodies it answers with. The turn itself is api/chat/'s, shared with the OpenAI surfaces."""
