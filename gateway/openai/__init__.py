"""The OpenAI-compatible HTTP API: protocol models, routes, serving of completions and
chat, error bodies."""
