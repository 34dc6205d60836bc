"""What chat completions and Responses share: a chat rendered by the model's template.

Both turn a chat request into engine requests by the same steps: the tools'
plan (gateway/tool_calling/plan.py) decides what the template renders and what
constrains the output, the server's output parsing (``--reasoning-parser``,
``--tool-call-parser``) reads each choice, and a constraint waits until the
reasoning has ended. Responses builds its chat request from its own fields
(gateway/responses/conversation.py) and then goes through these steps too.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.gateway.engine.client import GenerationRequest
from kvmesh.gateway.engine_params.structured_outputs import structured_output_spec
from kvmesh.gateway.engine_params.validation import Prompt, chat_prompt, truncate_prompts
from kvmesh.gateway.openai.output_parsing import OutputParser, OutputParsing
from kvmesh.gateway.openai.protocol import ChatCompletionRequest
from kvmesh.gateway.openai.serving_common import Serving, ServingContext, build_engine_requests
from kvmesh.gateway.tool_calling.plan import ToolPlan
from kvmesh.services.contracts.errors import InvalidRequestError
from kvmesh.services.contracts.lora_request import LoRARequest


@dataclass(frozen=True)
class PreparedChat:
    """A chat request ready to generate."""

    # The request as generated: special tokens kept where the output parser reads them.
    request: ChatCompletionRequest
    prompt: Prompt
    parsers: list[OutputParser]  # one per choice
    engine_requests: list[GenerationRequest]


class ChatTemplateServing(Serving):
    """An endpoint whose requests are chats, their output read by the server's parsers."""

    def __init__(
        self, context: ServingContext, output_parsing: OutputParsing | None = None
    ) -> None:
        super().__init__(context)
        self._parsing = output_parsing or OutputParsing()

    async def _prepare_chat(
        self,
        request_id: str,
        chat: ChatCompletionRequest,
        plan: ToolPlan,
        lora_request: LoRARequest | None,
        parsed_plan: ToolPlan | None = None,
        refuse_two_constraints: bool = True,
    ) -> PreparedChat:
        """Render, tokenize and truncate the chat's prompt; its parsers and constraint;
        one engine request per choice.

        ``plan`` renders the tools and forces calls; ``parsed_plan`` (default: the
        same) is what the parsers look for in the output. A forced call together
        with another structured output is refused with ``refuse_two_constraints``
        (chat completions, whose client set both), else the forced call wins.
        """
        parsed_plan = plan if parsed_plan is None else parsed_plan
        if self._parsing.keeps_special_tokens(parsed_plan) and chat.skip_special_tokens:
            # The format's markers are special tokens (vLLM's adjust_request does the same).
            chat = chat.model_copy(update={"skip_special_tokens": False})
        prompt = await self._tokenize(
            chat_prompt, chat, self._tokenizer, plan.tools if plan.renders_tools else None
        )
        max_model_len = self._engine.model_info.max_model_len
        (prompt,) = truncate_prompts([prompt], chat, self._tokenizer, max_model_len)
        constraint = plan.constraint()
        if (
            refuse_two_constraints
            and constraint is not None
            and structured_output_spec(chat) is not None
        ):
            raise InvalidRequestError(
                "a forced tool_choice cannot be combined with another structured output",
                param="tool_choice",
            )
        parsers = [
            self._parsing.parser(parsed_plan, prompt.text, chat.chat_template_kwargs)
            for _ in range(chat.n)
        ]
        constraint = self._parsing.after_reasoning(
            constraint or structured_output_spec(chat), parsers[0], self._tokenizer
        )
        engine_requests = build_engine_requests(
            request_id,
            [prompt],
            chat,
            self._engine.model_info,
            self._tokenizer,
            self._limits,
            structured_output=constraint,
            lora_request=lora_request,
        )
        return PreparedChat(chat, prompt, parsers, engine_requests)
