"""The detokenizer passes logprobs through to the gateway untouched, prompt logprobs included."""

from __future__ import annotations

from tokenizers import Tokenizer

from kvmesh.detokenizer.registry import DetokenizerTable
from kvmesh.detokenizer.service import DetokenizerEngine
from kvmesh.protos import common_pb2, scheduler_pb2


def test_prompt_logprobs_and_logprobs_reach_the_gateway(tokenizer: Tokenizer) -> None:
    engine = DetokenizerEngine(DetokenizerTable(tokenizer), "unused:0")
    prompt = tokenizer.encode("Hello there").ids
    scored = [common_pb2.TokenLogprobs(token_id=t, logprob=-1.5, rank=3) for t in prompt[1:]]
    sampled = common_pb2.TokenLogprobs(token_id=prompt[0], logprob=-0.25, rank=1)
    step = scheduler_pb2.StepOutputs(
        step_id=1,
        outputs=[
            scheduler_pb2.RequestOutput(
                request_id="r",
                new_token_ids=[prompt[0]],
                num_prompt_tokens=len(prompt),
                logprobs=[sampled],
                prompt_logprobs=scored,
                header=scheduler_pb2.RequestHeader(prompt_token_ids=prompt, client_id="gw"),
            )
        ],
    )
    per_client, _ = engine.process_step(step)
    (out,) = per_client["gw"]
    assert list(out.prompt_logprobs) == scored
    assert list(out.logprobs) == [sampled]
