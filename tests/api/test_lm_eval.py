"""lm-evaluation-harness itself against `bloompeer api`: its `local-completions` model (token-id
prompts, several per request, several requests in flight) scores a multiple-choice task and runs
a generate_until task through the swarm, and every per-sample loglikelihood equals that of its own
`hf` model on the same checkpoint within 1e-4, every generation and every metric is the same.

The tasks are defined here from local files (json data, a task yaml), and everything runs offline:
nothing is downloaded, the tokenizer comes from the checkpoint's directory.
"""

from __future__ import annotations

import json

import pytest

from .conftest import sample_value, scrape

TOLERANCE = 1e-4
PROMPTS_PER_REQUEST = 4
REQUESTS_IN_FLIGHT = 3

MULTIPLE_CHOICE = [
    {"question": "The swarm computes", "choices": [" blocks", " nothing", " a long answer here", " é"], "answer": 0},
    {"question": "Servers serve", "choices": [" blocks", " tea"], "answer": 1},
    {"question": "Which is a number?", "choices": [" seven", " green", " loud"], "answer": 0},
    {"question": "Bytes: ", "choices": ["é", "ü", "ab"], "answer": 2},
    {"question": "Once upon a time", "choices": ["eee", "abc"], "answer": 0},  # the random model repeats "e"
    {"question": "A question whose context is rather longer than the others, to pad", "choices": [" yes", " no"],
     "answer": 1},
]
GENERATE = [{"prompt": "Once upon a time", "target": " there"}, {"prompt": "Q: 2+2?\nA:", "target": " 4"},
            {"prompt": "né", "target": "x"}, {"prompt": "The end", "target": "."}, {"prompt": "Z", "target": "z"}]

TASKS = {
    "bloompeer_mc": """
task: bloompeer_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
target_delimiter: ""
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "bloompeer_gen": """
task: bloompeer_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n", "."]
  max_gen_toks: 10
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module")
def lm_eval(tmp_path_factory):
    """lm_eval, imported with everything it could fetch pointed offline and into a temp dir."""
    cache = tmp_path_factory.mktemp("lm-eval-cache")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                            "HF_DATASETS_CACHE": str(cache / "datasets"), "HF_HOME": str(cache / "hf")}.items():
            patch.setenv(name, value)
        import lm_eval
        import lm_eval.tasks

        yield lm_eval


@pytest.fixture(scope="module")
def task_manager(lm_eval, tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm-eval-tasks")
    for name, rows in (("bloompeer_mc", MULTIPLE_CHOICE), ("bloompeer_gen", GENERATE)):
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        (directory / f"{name}.yaml").write_text(TASKS[name].format(data=data))
    return lm_eval.tasks.TaskManager(include_path=str(directory), include_defaults=False)


def _evaluate(lm_eval, task_manager, model: str, model_args: dict, batch_size: int) -> dict:
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), batch_size=batch_size,
                                   task_manager=task_manager, log_samples=True, bootstrap_iters=0)


def _per_sample(results: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda sample: sample["doc_id"])]


def test_local_completions_through_the_swarm_equals_lm_evals_hf_model(lm_eval, task_manager, api, model_id,
                                                                      tiny_checkpoint):
    before = scrape(api)
    swarm = _evaluate(lm_eval, task_manager, "local-completions", {
        "model": model_id, "base_url": f"{api.url}/completions", "tokenizer": str(tiny_checkpoint),
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": REQUESTS_IN_FLIGHT,
        "max_retries": 1}, PROMPTS_PER_REQUEST)
    after = scrape(api)
    local = _evaluate(lm_eval, task_manager, "hf", {"pretrained": str(tiny_checkpoint), "dtype": "float32",
                                                    "device": "cpu"}, 1)

    scored, expected = _per_sample(swarm, "bloompeer_mc"), _per_sample(local, "bloompeer_mc")
    assert len(scored) == len(MULTIPLE_CHOICE)
    for got_doc, want_doc in zip(scored, expected):
        assert len(got_doc) == len(want_doc)
        for [(got, got_greedy)], [(want, want_greedy)] in zip(got_doc, want_doc):
            assert got == pytest.approx(want, abs=TOLERANCE)
            assert got_greedy == want_greedy
    assert any(greedy for doc in scored for [(_, greedy)] in doc)
    generated = _per_sample(swarm, "bloompeer_gen")
    assert generated == _per_sample(local, "bloompeer_gen")
    assert any(text for [[text]] in generated)
    for task in TASKS:
        assert swarm["results"][task] == local["results"][task]

    num_choices = sum(len(doc["choices"]) for doc in MULTIPLE_CHOICE)
    passes = sample_value(after, "bloompeer_api_scoring_passes_total", model=model_id) - \
        sample_value(before, "bloompeer_api_scoring_passes_total", model=model_id)
    assert passes == -(-num_choices // PROMPTS_PER_REQUEST)  # one pass per request of several prompts
