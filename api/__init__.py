"""`swarm-api`: an OpenAI-compatible HTTP server in front of a swarm (the client's side of it)."""
