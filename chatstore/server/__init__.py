"""Starting the API server: `run` (what `chatstore serve` runs: the backend built, uvicorn),
`launcher` (a server on a free port in this process or a child, for tests and benchmarks) and
`in_process` (`chatstore chat --local`). Apart from api/ because it builds the whole serving stack
(chatstore.serving), which itself builds api/'s app: api/ never imports serving."""
