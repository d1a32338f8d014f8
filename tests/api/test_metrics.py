"""GET /metrics (conftest.scrape): counters rise by at least what was generated."""

from __future__ import annotations

from .conftest import sample_value, scrape


def test_counters_rise_by_at_least_the_tokens_generated(api, client, model_id):
    before = scrape(api)
    response = client.completions.create(model=model_id, prompt="Count me", max_tokens=10, temperature=0)
    streamed = list(client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=6, temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    generated = response.usage.completion_tokens + streamed[-1].usage.completion_tokens
    after = scrape(api)

    def delta(name, **labels):
        return sample_value(after, name, **labels) - sample_value(before, name, **labels)

    assert generated > 0
    assert delta("bloompeer_api_generated_tokens_total", model=model_id) >= generated
    assert delta("bloompeer_api_prompt_tokens_total", model=model_id) >= response.usage.prompt_tokens
    assert delta("bloompeer_api_requests_total", endpoint="/v1/completions", code="200") >= 1
    assert delta("bloompeer_api_requests_total", endpoint="/v1/chat/completions", code="200") >= 1
    assert delta("bloompeer_api_time_to_first_token_seconds_count", model=model_id) >= 2
    assert delta("bloompeer_api_inter_token_latency_seconds_count", model=model_id) >= generated - 2
    assert sample_value(after, "bloompeer_api_generations_in_progress", model=model_id) == 0


def test_errors_are_counted_by_status_code(api, client):
    before = scrape(api)
    assert api.post_json("/v1/completions", {"model": "unknown", "prompt": "x"})[0] == 404
    after = scrape(api)
    key = ("bloompeer_api_requests_total", (("code", "404"), ("endpoint", "/v1/completions")))
    assert after[key] - before.get(key, 0.0) == 1
