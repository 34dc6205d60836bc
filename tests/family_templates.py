"""Chat templates in the style of each family's own, small enough to read in a test.

Each keeps what the gateway looks at: how tools are written into the prompt,
the markers of the family's tool-call format, and (Qwen3) the
``enable_thinking`` switch that closes the thinking in the prompt. They are
written for these tests, after the shape of the published templates.
"""

from __future__ import annotations

_MESSAGES = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' ~ message.role ~ '\\n' ~ (message.content or '') ~ '<|im_end|>\\n' }}"
    "{%- endfor %}"
)

# Qwen3: Hermes calls, <think> thinking, enable_thinking=false closes it in the prompt.
QWEN3 = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' ~ (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools>\\nFor each function call, return a json object within "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call><|im_end|>\\n' }}{%- endif %}"
    + _MESSAGES
    + "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)

# Qwen3-Coder: XML calls inside <tool_call>.
QWEN3_CODER = (
    "{%- if tools %}{{ '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n<function>' ~ tool.function.name ~ '</function>' }}"
    "{%- endfor %}{{ '\\n</tools>\\nCall a function like this:\\n<tool_call>\\n"
    "<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n"
    "</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}{%- endif %}"
    + _MESSAGES
    + "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1: JSON calls with "parameters", <|python_tag|> for code.
LLAMA3_JSON = (
    "{{ bos_token }}{%- if tools %}{{ '<|start_header_id|>user<|end_header_id|>\\n\\n"
    "Given the following functions, please respond with a JSON for a function call. "
    'Respond in the format {\\"name\\": function name, \\"parameters\\": dictionary of '
    "argument name and its value}.\\n' }}"
    "{%- for tool in tools %}{{ (tool | tojson) ~ '\\n' }}{%- endfor %}"
    "{{ '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}{{ '<|start_header_id|>' ~ message.role ~ "
    "'<|end_header_id|>\\n\\n' ~ (message.content or '') ~ '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Llama 3.2 / 4 pythonic.
PYTHONIC = (
    "{%- if tools %}{{ '<|start_header_id|>system<|end_header_id|>\\n\\n"
    "If you decide to invoke any of the function(s), you MUST put it in the format of "
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), "
    "func_name2(params)]\\n' }}{%- for tool in tools %}{{ (tool | tojson) ~ '\\n' }}"
    "{%- endfor %}{{ '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}{{ '<|start_header_id|>' ~ message.role ~ "
    "'<|end_header_id|>\\n\\n' ~ (message.content or '') ~ '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)

# Mistral: [AVAILABLE_TOOLS] in the prompt, [TOOL_CALLS] in the answer.
MISTRAL = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- if loop.last and tools %}{{ '[AVAILABLE_TOOLS]' ~ (tools | tojson) ~ "
    "'[/AVAILABLE_TOOLS]' }}{%- endif %}"
    "{%- if message.role == 'user' %}{{ '[INST]' ~ message.content ~ '[/INST]' }}"
    "{%- elif message.tool_calls %}{{ '[TOOL_CALLS]' ~ (message.tool_calls | tojson) }}"
    "{%- else %}{{ message.content or '' }}{%- endif %}{%- endfor %}"
)

FAMILY_TEMPLATES = {
    "hermes": QWEN3,
    "qwen3_coder": QWEN3_CODER,
    "llama3_json": LLAMA3_JSON,
    "pythonic": PYTHONIC,
    "mistral": MISTRAL,
}
