"""OpenAI tool calling on /v1/chat/completions: the request's tools and tool choice
(protocol, request), the prompt through the model's template or the generic JSON form
(formats, rendering), the reply's calls parsed back out (parsers) and streamed (streaming)."""
