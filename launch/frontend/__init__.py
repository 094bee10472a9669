"""The HTTP front: an OpenAI-compatible server (FastAPI) over an `LLM` whose leader runs in this process.
`api_server` builds the app and attaches it to an engine; `engine_client` bridges the leader's inbox/outbox to
the asyncio handlers; `generate`, `tokens`, `text` and `logprobs` turn requests into engine commands and
engine output into OpenAI answers; `protocol` and `chat` hold the request shapes, `answer`, `reasoning` and
`tools` shape chat answers (reasoning, content, tool calls), `metrics` the /metrics series and `access_log` the
one-line-per-request log. Importing this package imports none of them (nor FastAPI)."""
