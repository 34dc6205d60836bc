"""Structured outputs in the worker: compile grammars, keep one matcher per request.

The scheduler asks the worker to compile a request's grammar
(``GrammarCompilerCache.compile``, run in a thread pool by the gRPC servicer)
before it queues the request, so compiling never stalls a step. When the
request then arrives in a step, ``StructuredOutputManager`` finds the compiled
grammar in the cache (compiling it on the spot only if nobody prepared it, as
the in-process driver does), creates an xgrammar ``GrammarMatcher`` and, after
a preemption, replays the tokens generated so far into it.

Each step, ``constrain`` fills a packed token bitmask for the sampling rows of
constrained requests; the sampler applies it to the logits at the allowed-token
mask position, before every other processor. ``StepGrammar.accept`` then
advances the matchers with the sampled tokens. A complete text leaves only the
stop token (the model's first EOS, the one the scheduler stops on) allowed, so
the normal EOS stop ends the request.

A request that starts inside the model's thinking (its spec carries the
reasoning parser's end tag as ``reasoning_end_token_ids``) samples freely
until its output holds that sequence; its grammar starts with the next token,
as vLLM applies structured output once reasoning ended.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr

from kvmesh.services.contracts.sampling_params import StructuredOutputSpec

logger = logging.getLogger(__name__)


def choice_grammar(value: str) -> str:
    """EBNF for "exactly one of these strings"; ValueError unless a non-empty string list."""
    try:
        choices = json.loads(value)
    except json.JSONDecodeError as exc:
        raise ValueError(f"choice must be a JSON array of strings: {exc}") from None
    if not isinstance(choices, list) or not choices:
        raise ValueError("choice must be a non-empty array of strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError("every choice must be a non-empty string")
    # JSON string literals are valid EBNF string literals (same escapes).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class GrammarCompilerCache:
    """xgrammar's compiler over the model's tokenizer, plus compiled grammars by spec.

    Thread-safe: the servicer compiles from a thread pool while the step thread
    reads the cache. The tokenizer is loaded on first use, so a worker that never
    sees a structured request never pays for it.
    """

    def __init__(
        self,
        tokenizer_path: str | Path,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        max_threads: int = 2,
    ) -> None:
        self.tokenizer_path = str(tokenizer_path)
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_threads = max_threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: dict[StructuredOutputSpec, xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
                logger.info("grammar compiler ready (vocab %d)", self.vocab_size)
            return self._compiler

    def get(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar | None:
        with self._lock:
            return self._compiled.get(spec.grammar)

    def compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        """The compiled grammar for ``spec`` (its reasoning gate aside); ValueError when it
        does not compile."""
        spec = spec.grammar
        cached = self.get(spec)
        if cached is not None:
            return cached
        compiler = self._get_compiler()
        try:
            compiled = self._compile(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            # xgrammar reports every parse error as RuntimeError with a C++ prefix.
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
            raise ValueError(f"invalid {spec.kind} for structured output: {message}") from None
        with self._lock:
            self._compiled[spec] = compiled
        return compiled

    @staticmethod
    def _compile(compiler: xgr.GrammarCompiler, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        # Compact JSON (no free whitespace): a small model otherwise tends to
        # spend its whole token budget on newlines and spaces.
        if spec.kind == "json":
            return compiler.compile_json_schema(spec.value, any_whitespace=False)
        if spec.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return compiler.compile_regex(spec.value)
        if spec.kind == "choice":
            return compiler.compile_grammar(choice_grammar(spec.value))
        if spec.kind == "grammar":
            return compiler.compile_grammar(spec.value)
        raise ValueError(f"unknown structured output kind {spec.kind!r}")


def find_sequence(tokens: Sequence[int], sequence: Sequence[int]) -> int | None:
    """Where ``sequence`` first starts in ``tokens`` (None if absent)."""
    width = len(sequence)
    for start in range(len(tokens) - width + 1):
        if list(tokens[start : start + width]) == list(sequence):
            return start
    return None


@dataclass
class _Thinking:
    """A constrained request still in its reasoning: its grammar waits for ``end``."""

    compiled: xgr.CompiledGrammar
    end: tuple[int, ...]
    tail: list[int]  # the last len(end) output tokens, to spot the end as it is sampled


@dataclass
class StepGrammar:
    """The constrained sampling rows of one step, the bitmask to apply to them, and the
    rows of requests still thinking (sampled freely, watched for the end of the thinking)."""

    bitmask: torch.Tensor | None  # [num_sampling_rows, ceil(vocab / 32)] int32; None: no row
    positions: list[int]  # sampling-row positions of the constrained requests
    req_ids: list[str]  # parallel to positions
    manager: StructuredOutputManager
    thinking_positions: list[int] = field(default_factory=list)
    thinking_req_ids: list[str] = field(default_factory=list)

    def accept(self, token_ids: Sequence[int]) -> None:
        """Advance each constrained request's matcher by its sampled token."""
        self.manager.accept(self.req_ids, [int(token_ids[p]) for p in self.positions])
        self.manager.watch_thinking(
            self.thinking_req_ids, [int(token_ids[p]) for p in self.thinking_positions]
        )


class StructuredOutputManager:
    """One ``GrammarMatcher`` per constrained request held by the worker."""

    def __init__(self, compiler: GrammarCompilerCache) -> None:
        self.compiler = compiler
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        self._thinking: dict[str, _Thinking] = {}
        # Requests whose sampled token the grammar rejected: req_id -> message.
        self._errors: dict[str, str] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._matchers or req_id in self._thinking

    @property
    def num_requests(self) -> int:
        return len(self._matchers) + len(self._thinking)

    def is_thinking(self, req_id: str) -> bool:
        """Whether the request's grammar still waits for the end of its thinking."""
        return req_id in self._thinking

    def add_request(
        self, req_id: str, spec: StructuredOutputSpec, output_token_ids: Sequence[int]
    ) -> None:
        """Start (or restart after preemption) a request's matcher; ValueError if unusable.

        With a reasoning gate, only the tokens after the end of the thinking
        are the grammar's; a request still thinking waits for that end.
        """
        compiled = self.compiler.get(spec.grammar)
        if compiled is None:
            logger.info("request %s: grammar was not prepared; compiling in the step", req_id)
            compiled = self.compiler.compile(spec.grammar)
        tokens = [int(token_id) for token_id in output_token_ids]
        end = spec.reasoning_end_token_ids
        if end:
            start = find_sequence(tokens, end)
            if start is None:
                self._thinking[req_id] = _Thinking(compiled, end, tokens[-len(end) :])
                return
            tokens = tokens[start + len(end) :]
        self._start_matcher(req_id, compiled, tokens)

    def _start_matcher(
        self, req_id: str, compiled: xgr.CompiledGrammar, replay: Sequence[int]
    ) -> None:
        matcher = xgr.GrammarMatcher(
            compiled, override_stop_tokens=self.compiler.stop_token_ids[:1] or None
        )
        for token_id in replay:
            if not matcher.accept_token(int(token_id)):
                raise ValueError(f"replayed token {token_id} does not fit the grammar")
        self._matchers[req_id] = matcher

    def remove_request(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)
        self._thinking.pop(req_id, None)
        self._errors.pop(req_id, None)

    def watch_thinking(self, req_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        """Note each thinking request's sampled token; once its thinking ended, its grammar
        constrains the next token."""
        for req_id, token_id in zip(req_ids, token_ids, strict=True):
            thinking = self._thinking.get(req_id)
            if thinking is None:
                continue
            thinking.tail = [*thinking.tail, token_id][-len(thinking.end) :]
            if tuple(thinking.tail) == thinking.end:
                del self._thinking[req_id]
                self._start_matcher(req_id, thinking.compiled, ())
                logger.debug("request %s: thinking ended; structured output starts", req_id)

    def constrain(self, sample_rows: np.ndarray, row_of: Mapping[str, int]) -> StepGrammar | None:
        """The bitmask for this step's sampling rows (``sample_rows``: batch rows in order)."""
        if not self._matchers and not self._thinking:
            return None
        position_of_row = {int(row): i for i, row in enumerate(sample_rows)}
        thinking_positions: list[int] = []
        thinking_req_ids: list[str] = []
        for req_id in self._thinking:
            position = position_of_row.get(row_of.get(req_id, -1))
            if position is not None:
                thinking_positions.append(position)
                thinking_req_ids.append(req_id)
        positions: list[int] = []
        req_ids: list[str] = []
        for req_id, matcher in self._matchers.items():
            position = position_of_row.get(row_of.get(req_id, -1))
            # A terminated matcher already took its stop token; the request ends
            # this step (a driver that ignores EOS samples freely after it).
            if position is not None and not matcher.is_terminated():
                positions.append(position)
                req_ids.append(req_id)
        if not positions and not thinking_positions:
            return None
        bitmask = None
        if positions:
            bitmask = xgr.allocate_token_bitmask(len(sample_rows), self.compiler.vocab_size)
            for position, req_id in zip(positions, req_ids, strict=True):
                self._matchers[req_id].fill_next_token_bitmask(bitmask, position)
        return StepGrammar(
            bitmask=bitmask,
            positions=positions,
            req_ids=req_ids,
            manager=self,
            thinking_positions=thinking_positions,
            thinking_req_ids=thinking_req_ids,
        )

    def accept(self, req_ids: Sequence[str], token_ids: Sequence[int]) -> None:
        for req_id, token_id in zip(req_ids, token_ids, strict=True):
            matcher = self._matchers.get(req_id)
            if matcher is None or matcher.is_terminated():
                continue
            if not matcher.accept_token(token_id):
                # Only possible when every token was masked (e.g. min_tokens
                # forbids the EOS that a complete grammar requires).
                self._errors[req_id] = (
                    f"sampled token {token_id} violates the structured output grammar"
                )
                logger.warning("request %s: %s", req_id, self._errors[req_id])

    def pop_errors(self) -> dict[str, str]:
        errors, self._errors = self._errors, {}
        return errors
