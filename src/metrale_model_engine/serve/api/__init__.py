"""The HTTP API's endpoints and what they write, over the server's engine: ``app`` (the FastAPI app and its error
handlers), ``routes`` (the two generating endpoints), ``streams`` (one request's choices as they arrive, as
OpenAI's JSON), ``text`` (tokens to text, stop strings held back) and ``chat`` (chat templates, in a sandbox)."""
