"""Tool calling: the request's tools, each model family's call format, streamed call deltas.

- ``plan.py``: tools and tool_choice validated into a ``ToolPlan`` (mode,
  functions, the JSON-schema constraint of the forced modes).
- ``prompt.py``: tools and earlier calls for templates that ignore tools.
- ``events.py``: what parsers emit (content, ``ToolCallStart``,
  ``ToolCallArguments``) and the ``ToolCallStream`` protocol they implement.
- one module per format: ``hermes.py``, ``llama3_json.py``, ``mistral.py``,
  ``pythonic.py``, ``qwen3_coder.py``; ``forced.py`` for the forced modes.
- ``registry.py``: the formats by ``--tool-call-parser`` name, and the one a
  chat template implies.
- ``deltas.py``: parsed calls in OpenAI's response and chunk shapes.

gateway/openai/output_parsing.py puts reasoning and tool parsing together per generation.
"""
