"""`ulorl serve`'s OpenAI-compatible HTTP API over the shared PolicyEngine (README "Serving").

Layout: `protocol` (request fields, checked), `errors` (OpenAI's error body), `driver` (the engine thread
that decodes every client's requests in one continuous batch), `scoring` (prompt / top-k log-probs),
`text` (detokenisation, stop strings, log-prob fields), `formats` (response and chunk shapes), `app`
(FastAPI routes, streaming), `server` (the command). Nothing here is imported by `ulorl --help`.
"""
