"""The chat turn every API surface shares (sessions, OpenAI chat completions, Responses): the chat
service (a turn opened, run and saved), the turn in flight, what a turn needs before and after
the engine, the sessions' reservations and limits, and the session records' CRUD behind them."""
