"""OpenAI's Responses API (POST/GET/DELETE /v1/responses) on top of the chat machinery.

A Responses request becomes a chat completion request (conversation.py): its
input items, instructions and the stored history of ``previous_response_id``
turn into chat messages, its function tools and ``text.format`` into chat's
tools and response format. From there the chat path's own pieces do the work:
the chat template, tool planning (forced calls as a JSON-schema constraint,
the ``--tool-call-parser`` format for "auto"), sampling-parameter validation,
the engine fan-out and the output parser (thinking, content and calls). What
is new here is the output side: output items and usage (output.py), the
typed stream of ``response.*`` events (events.py), and the store that keeps
responses for ``previous_response_id`` and GET (store.py).
"""
