"""OpenAI's Responses API (/v1/responses): routes, protocol, and its serving (body, chain,
events, store)."""
