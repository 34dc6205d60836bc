"""kvmesh.LLM: the engine in process gives transformers' greedy tokens, and its
text, stop handling and chat match what the served stack would return."""

from __future__ import annotations

import pytest

import kvmesh
from kvmesh.services.runtime.model_prep import default_model_path, is_prepared
from tests.e2e import hf_oracle

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is",
    "def fibonacci(n):\n    # return the n-th Fibonacci number\n",
    "List three facts about the moon. 1.",
]
GREEDY = kvmesh.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> kvmesh.LLM:
    if not is_prepared(default_model_path()):
        pytest.skip("default model not prepared (run `make install`)")
    # float32: the dtype transformers is compared in (auto may pick bf16);
    # one thread: the 2-core test box is shared.
    return kvmesh.LLM(dtype="float32", num_kv_blocks=128, max_model_len=512, num_threads=1)


def test_greedy_batch_equals_transformers(llm: kvmesh.LLM) -> None:
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.prompt for o in outputs] == PROMPTS
    tokenizer = hf_oracle.tokenizer()
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = tokenizer(prompt)["input_ids"]
        assert output.prompt_token_ids == ids
        (sample,) = output.outputs
        assert sample.token_ids == hf_oracle.greedy(ids, 12)
        assert sample.text == tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        assert sample.finish_reason == "length" and sample.stop_reason is None


def test_token_id_prompt_and_per_prompt_params(llm: kvmesh.LLM) -> None:
    ids = hf_oracle.tokenizer()(PROMPTS[0])["input_ids"]
    short = kvmesh.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    by_ids, by_text = llm.generate([ids, PROMPTS[0]], [short, GREEDY])
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids[:3]
    (single,) = llm.generate(ids, short)  # one prompt as a bare list of ids
    assert single.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_stop_string_ends_the_text_and_the_request(llm: kvmesh.LLM) -> None:
    (full,) = llm.generate(PROMPTS[2], GREEDY)
    text = full.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text[: text.index(stop)]
    (out,) = llm.generate(
        PROMPTS[2], kvmesh.SamplingParams(temperature=0.0, max_tokens=12, stop=stop)
    )
    sample = out.outputs[0]
    assert sample.text == cut
    assert (sample.finish_reason, sample.stop_reason) == ("stop", stop)
    # The request ended when the text did: fewer tokens than max_tokens.
    assert len(sample.token_ids) < 12
    assert sample.token_ids == full.outputs[0].token_ids[: len(sample.token_ids)]
    (kept,) = llm.generate(
        PROMPTS[2],
        kvmesh.SamplingParams(
            temperature=0.0, max_tokens=12, stop=stop, include_stop_str_in_output=True
        ),
    )
    assert kept.outputs[0].text == cut + stop


def test_stop_token_id(llm: kvmesh.LLM) -> None:
    (full,) = llm.generate(PROMPTS[0], GREEDY)
    third = full.outputs[0].token_ids[2]
    (out,) = llm.generate(
        PROMPTS[0], kvmesh.SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[third])
    )
    sample = out.outputs[0]
    first = full.outputs[0].token_ids.index(third)
    assert sample.token_ids == full.outputs[0].token_ids[: first + 1]
    assert (sample.finish_reason, sample.stop_reason) == ("stop", third)


def test_chat_renders_the_models_template(llm: kvmesh.LLM) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    (out,) = llm.chat(messages, kvmesh.SamplingParams(temperature=0.0, max_tokens=10))
    tokenizer = hf_oracle.tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids == ids
    expected = hf_oracle.greedy(ids, 10, stop_at_eos=True)
    assert out.outputs[0].token_ids == expected
    # Two conversations at once: a list of lists.
    both = llm.chat([messages, messages], kvmesh.SamplingParams(temperature=0.0, max_tokens=10))
    assert [o.outputs[0].token_ids for o in both] == [expected, expected]


def test_n_samples_with_a_seed(llm: kvmesh.LLM) -> None:
    (out,) = llm.generate(
        PROMPTS[1],
        kvmesh.SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True),
    )
    assert [s.index for s in out.outputs] == [0, 1, 2]
    # The same seed draws the same tokens for every sample, as the server does.
    assert len({tuple(s.token_ids) for s in out.outputs}) == 1
    assert all(len(s.token_ids) == 6 for s in out.outputs)


def test_bad_prompts_raise_before_anything_runs(llm: kvmesh.LLM) -> None:
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([1] * 510, kvmesh.SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 10**7]])
    with pytest.raises(ValueError, match="at least one token"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "assistant", "content": "hi"}, {"rolex": "user"}])
    assert not llm.engine.has_unfinished_requests()
    # The engine still serves after refusing.
    (out,) = llm.generate(PROMPTS[0], kvmesh.SamplingParams(temperature=0.0, max_tokens=2))
    assert len(out.outputs[0].token_ids) == 2


def test_samples_of_one_prompt_compute_it_once(llm: kvmesh.LLM) -> None:
    prompt = "A prompt of several blocks, seen by no other test: " + "lantern harbor " * 20
    num_tokens = len(hf_oracle.tokenizer()(prompt)["input_ids"])
    llm.engine.scheduler.make_stats()  # counters restart from here
    (out,) = llm.generate(
        prompt, kvmesh.SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=2, ignore_eos=True)
    )
    stats = llm.engine.scheduler.make_stats()
    assert len(out.outputs) == 3
    # The first sample computes the prompt; the other two hit its full blocks.
    full_blocks = (num_tokens - 1) // 16 * 16
    assert stats.prefix_cache_hits == 2 * full_blocks
