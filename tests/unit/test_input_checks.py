"""Hardening below the HTTP layer, unit: SamplingParams and validate_request refuse every value that
would break a step (ints that do not fit int64, seeds outside torch's range, non-finite floats, too
many stop strings, token ids outside the vocabulary); request bodies that are not UTF-8 JSON objects
of bounded depth; admission tickets that release once; metrics that forget replaced replicas.

The engine side is tests/engine/test_hardening.py; the HTTP side (abort storms, malformed requests,
schemathesis fuzzing) runs on the live apps of tests/serving/."""
from __future__ import annotations

import gc
import json

import pytest
from pydantic import ValidationError

from engine import SamplingParams
from records.engine_stats import EngineStats
from records.errors import InvalidRequestError
from records.sampling_params import validate_request
from router.ingress.admission import Admission
from router.ingress.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from router.ingress.request_body import MAX_JSON_DEPTH, UNSUPPORTED, parse_json_object, validation_message
from router.ingress.responses_request import ResponsesRequest


# --- unit -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    ({"top_k": 2**70, "temperature": 1.0}, "top_k"), ({"seed": 2**64}, "seed"), ({"seed": -2**63 - 1}, "seed"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"max_tokens": 2**63}, "max_tokens"), ({"min_tokens": 2**63}, "min_tokens"), ({"priority": 2**70}, "priority"),
    ({"n": 2**64}, "n"), ({"stop": ["x"] * 1000}, "stop"), ({"stop": ["y" * 257]}, "stop"),
    ({"stop_token_ids": [2**70]}, "stop_token_ids"), ({"stop_token_ids": list(range(300))}, "stop_token_ids"),
    ({"logprobs": True}, "logprobs"), ({"stop": 5}, "stop"),
])
def test_sampling_params_refuse_what_would_break_a_step(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SamplingParams(**kwargs)


def test_edge_values_that_are_accepted():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1          # torch's seed range, all of it
    assert SamplingParams(seed=-2**63, top_k=2**63 - 1, stop=["z" * 256] * 32).top_k == 2**63 - 1


def test_validate_request_knows_the_model():
    params = SamplingParams(stop_token_ids=[5, 1000])
    with pytest.raises(ValueError, match=r"stop_token_ids must be token ids in \[0, 1000\)"):
        validate_request([1, 2], params, vocab_size=1000, max_model_len=64)
    with pytest.raises(ValueError, match="n must be <= 4"):
        validate_request([1, 2], SamplingParams(n=5), 1000, 64, max_num_seqs=4)
    with pytest.raises(ValueError, match="min_tokens must be <= 62"):
        validate_request([1, 2], SamplingParams(min_tokens=63, max_tokens=None), 1000, 64)


@pytest.mark.parametrize("kwargs,prompt,field", [
    ({"stop_token_ids": [1000]}, [1], "stop_token_ids"), ({"logit_bias": {1000: 1.0}}, [1], "logit_bias"),
    ({"n": 5}, [1], "n"), ({"max_tokens": 64}, [1], "max_tokens"), ({"min_tokens": 64, "max_tokens": None}, [1],
                                                                    "min_tokens"),
    ({}, [1] * 64, "prompt"), ({}, [1000], "prompt"), ({}, [], "prompt"),
    ({"prompt_logprobs": 1, "n": 2}, [1], "prompt_logprobs"),
    ({"allowed_token_ids": [3, 1000]}, [1], "allowed_token_ids"),
    ({"bad_words_token_ids": [[3], [4, 1000]]}, [1], "bad_words"),
])
def test_validate_request_names_the_field_at_fault(kwargs, prompt, field):
    """The 400's `param` is the field the message names (a logit_bias outside the vocabulary once
    came back as param "prompt")."""
    with pytest.raises(InvalidRequestError) as caught:
        validate_request(prompt, SamplingParams(**kwargs), vocab_size=1000, max_model_len=64, max_num_seqs=4)
    assert caught.value.param == field and field.split("_")[0] in str(caught.value)


def test_a_null_field_is_a_field_not_sent():
    """OpenAI marks optional fields nullable and clients in several languages send unset ones as
    null: each is the field's default (the model's, where it has one: it stays unset), every field
    of every request model; a null that means something keeps its meaning (a completion's
    max_tokens: no limit), and a required field's null is still refused, named."""
    nulls = dict.fromkeys(["max_tokens", "max_completion_tokens", "stop", "n", "temperature", "top_p", "logprobs",
                           "top_logprobs", "seed", "tools", "tool_choice", "response_format", "stream",
                           "stream_options", "presence_penalty", "frequency_penalty", "logit_bias", "user",
                           "parallel_tool_calls", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
                           "skip_special_tokens", "add_generation_prompt", "functions", "function_call",
                           "reasoning_effort", "audio", "prediction", "not_a_field"])
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi", "name": None, "refusal": None}], **nulls)
    assert chat.model_fields_set == {"messages"} and chat.messages[0].model_fields_set == {"role", "content"}
    params = chat.to_sampling_params(defaults=(("temperature", 0.6), ("top_p", 0.9)))
    default = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert params == default.to_sampling_params(defaults=(("temperature", 0.6), ("top_p", 0.9)))
    assert (params.temperature, params.top_p, params.n, chat.stream) == (0.6, 0.9, 1, False)
    completion = CompletionRequest(prompt="hi", max_tokens=None, echo=None, suffix=None, logprobs=None, n=None)
    assert completion.max_tokens is None and CompletionRequest(prompt="hi").max_tokens == 16
    assert not completion.echo and completion.n == 1
    tool = {"type": "function", "function": {"name": "f", "description": None, "parameters": None, "strict": None}}
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[tool]).tool_list() == [
        {"type": "function", "function": {"name": "f"}}]
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], allowed_token_ids=[3, 4]
                                 ).to_sampling_params().allowed_token_ids == [3, 4]      # vLLM's extra, passed on
    assert CompletionRequest(prompt="x", bad_words=["a b"]).to_sampling_params().bad_words == ["a b"]
    responses = ResponsesRequest(input="hi", temperature=None, stream=None, parallel_tool_calls=None, text=None)
    assert responses.stream is False and responses.parallel_tool_calls
    assert EmbeddingRequest(input="hi", encoding_format=None, add_special_tokens=None).encoding_format == "float"
    for model, body, field in [(ChatCompletionRequest, {"messages": None}, "messages"),
                               (ChatCompletionRequest, {"messages": [{"role": None}]}, "messages.role"),
                               (CompletionRequest, {"prompt": None}, "prompt")]:
        with pytest.raises(ValidationError) as caught:
            model(**body)
        message, param = validation_message(caught.value)
        assert param.startswith(field) and message.endswith("got None"), message


@pytest.mark.parametrize("body,message", [
    (b'{"model": "m", "prompt": "\xff\xfe"}', "not valid UTF-8"),
    (b'{"temperature": NaN}', "NaN is not a JSON number"),
    (b'{"temperature": Infinity}', "Infinity is not a JSON number"),
    (b"[" * 2000 + b"]" * 2000, "nests arrays and objects more than"),
    (b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}", "nests arrays and objects more than"),
    (b'[1, 2]', "must be a JSON object; got list"),
    (b'{"model": ', "not valid JSON"),
])
def test_bodies_that_are_refused(body, message):
    with pytest.raises(ValueError, match=message):
        parse_json_object(body)


def test_bodies_that_are_accepted():
    nested = {"a": json.loads("[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2))}
    assert parse_json_object(json.dumps(nested).encode()) == nested
    assert parse_json_object(b"") == {} and parse_json_object('{"p": "café"}'.encode()) == {"p": "café"}


def test_admission_tickets_release_exactly_once():
    from records.errors import RateLimitError
    from records.serving import ServingSpec
    from router.ingress.tenants import Tenants

    seen = []
    admission = Admission(3, seen.append)
    tenant = Tenants(ServingSpec(), {}).resolve(None)
    a = admission.admit(tenant, 2)
    with pytest.raises(RateLimitError, match="limit is 3"):
        admission.admit(tenant, 2)
    assert admission.in_flight == 2
    a.release()
    a.release()                                   # idempotent
    assert admission.in_flight == 0 and seen == [2, 0]
    b = admission.admit(tenant, 3)
    assert b is not None and admission.in_flight == 3
    del b                                         # dropped unreleased: garbage collection releases it
    gc.collect()
    assert admission.in_flight == 0


def test_series_of_removed_replicas_are_dropped():
    from records.serving import PolicyConfig
    from router.routing.metrics import ServingMetrics
    from router.routing.policy import RoutingPolicy
    from router.routing.pool_router import RequestRouter

    metrics = ServingMetrics()
    router = RequestRouter("prefill", {"prefill-0": object(), "prefill-1": object()}, 16,
                           RoutingPolicy(PolicyConfig("prefix_aware", 0.5, 8), 8), metrics)
    for r in router.replicas:
        metrics.engines.set_stats("prefill", r, EngineStats(num_requests_running=1, prompt_tokens=10))
    router.set_replicas({"prefill-1": router.replicas["prefill-1"]})
    text = metrics.render()
    assert 'replica="prefill-1"' in text and 'replica="prefill-0"' not in text


# vLLM 0.32's completion and chat request fields (vllm.entrypoints.openai.{completion,chat_completion}
# .protocol: its request models' model_fields, in their order): a client written for vLLM sends them.
VLLM_COMPLETION_FIELDS = (
    "model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop "
    "stream stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty "
    "watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens "
    "skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side "
    "allowed_token_ids prompt_logprobs logprob_token_ids bad_words prompt_embeds add_special_tokens "
    "response_format structured_outputs priority request_id session_id return_tokens_as_token_ids "
    "return_token_ids routed_experts_prompt_start return_token_offsets mm_payload return_mm_kwargs "
    "cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection "
    "thinking_token_budget stream_interval").split()
VLLM_CHAT_FIELDS = (
    "messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n "
    "presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice "
    "reasoning_effort thinking_token_budget include_reasoning parallel_tool_calls user use_beam_search "
    "top_k min_p repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output "
    "ignore_eos min_tokens skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens "
    "truncation_side prompt_logprobs logprob_token_ids allowed_token_ids bad_words echo "
    "add_generation_prompt continue_final_message add_special_tokens documents chat_template "
    "chat_template_kwargs media_io_kwargs mm_processor_kwargs structured_outputs priority request_id "
    "session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start "
    "return_token_offsets return_prompt_text mm_payload return_mm_kwargs cache_salt kv_transfer_params "
    "ec_transfer_params vllm_xargs repetition_detection stream_interval").split()


@pytest.mark.parametrize("model,fields", [(CompletionRequest, VLLM_COMPLETION_FIELDS),
                                          (ChatCompletionRequest, VLLM_CHAT_FIELDS)])
def test_every_vllm_request_field_is_taken_or_refused_saying_why(model, fields):
    """Each field vLLM defines is either one of the request's own or refused with its reason (not as an
    unknown field), so that a client written for vLLM learns what to change."""
    assert [f for f in fields if f not in model.model_fields and f not in UNSUPPORTED] == []
    for field in (f for f in fields if f in UNSUPPORTED):
        message, param = validation_message(_refusal(model, field))
        assert param == field and message == f"{field}: {UNSUPPORTED[field]}"


def _refusal(model, field: str) -> ValidationError:
    body = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    try:
        model.model_validate({**body, field: 1})
    except ValidationError as e:
        return e
    raise AssertionError(f"{field} was taken")
