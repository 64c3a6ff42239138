"""/v1/completions as evaluation harnesses use it, through the real `openai` client and
lm-eval's `local-completions` model against a worker's HTTP server: echo with prompt
logprobs (against mlx-lm's model run dense over the prompt), max_tokens=0, prompt
lists, n > 1 (streamed too), vLLM's prompt_logprobs, and the refusals."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import openai
import pytest
from mlx_lm.utils import load

from cluster.sdk import Client

PROMPT = "The orchard is quiet in the morning, and the bees are slow."


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    """(tokenizer, dense log-softmax [len, vocab] of a token list), mlx-lm float32."""
    model, tokenizer = load(str(tiny_model_dir))

    def dense(ids: list[int]) -> np.ndarray:
        logits = model(mx.array(ids)[None]).astype(mx.float32)[0]
        return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))

    return tokenizer, dense


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(oai, oracle):
    tokenizer, dense = oracle
    ids = tokenizer.encode(PROMPT)
    r = oai.completions.create(model="", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length"
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) and lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = dense(ids)
    np.testing.assert_allclose(lp.token_logprobs[1:], ref[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)
    for pos, top in enumerate(lp.top_logprobs[1:]):
        best = np.sort(ref[pos])[::-1][:2]
        assert 1 <= len(top) <= 2  # keyed by token text: two tokens may share one (a split character)
        assert abs(max(top.values()) - best[0]) < 1e-4
        assert all(min(abs(v - best)) < 1e-4 for v in top.values())
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 0)


def test_echo_puts_the_prompt_before_the_completion(oai, tiny_worker):
    plain = oai.completions.create(model="", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1,
                                   extra_body={"ignore_eos": True})
    echoed = oai.completions.create(model="", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=1, echo=True,
                                    extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    n_prompt = echoed.usage.prompt_tokens
    lp = echoed.choices[0].logprobs
    assert len(lp.token_logprobs) == n_prompt + 5
    np.testing.assert_allclose(lp.token_logprobs[n_prompt:], plain.choices[0].logprobs.token_logprobs, atol=1e-5)
    assert lp.tokens[n_prompt:] == plain.choices[0].logprobs.tokens
    # echo without logprobs: the text alone; a token-id prompt is echoed as its text
    with Client(tiny_worker.grpc, timeout=60) as client:
        ids = client.generate(PROMPT, max_tokens=1, echo=True).prompt_token_ids
    r = oai.completions.create(model="", prompt=ids, max_tokens=3, temperature=0, echo=True,
                               extra_body={"ignore_eos": True})
    assert r.choices[0].text.startswith(PROMPT) and r.choices[0].logprobs is None


def test_a_list_of_prompts_with_n_gives_choices_prompt_by_prompt(oai):
    prompts = ["An apple", "A pear tree in the", "Blossoms"]
    seed = 7
    r = oai.completions.create(model="", prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=seed,
                               extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    singles = [oai.completions.create(model="", prompt=p, max_tokens=6, temperature=1.0, seed=seed + j,
                                      extra_body={"ignore_eos": True}).choices[0].text
               for p in prompts for j in range(2)]
    assert [c.text for c in r.choices] == singles  # sample j of a prompt draws from seed + j
    assert r.usage.completion_tokens == 6 * 6
    prompt_tokens = sum(oai.completions.create(model="", prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts)
    assert r.usage.prompt_tokens == prompt_tokens


def test_every_prompt_of_a_list_is_constrained_as_the_body_asks(oai):
    """The body's structured output (and its penalties and logit_bias, read in the same
    pass) reach every prompt of a list, not only the first."""
    choices = ["ripe apples", "green pears"]
    r = oai.completions.create(model="", prompt=["An apple", "A pear tree in the", "Blossoms"], max_tokens=8,
                               temperature=1.0, seed=5, extra_body={"guided_choice": choices})
    assert [c.text in choices for c in r.choices] == [True] * 3, [c.text for c in r.choices]


def test_token_id_prompt_lists_and_greedy_n(oai, oracle):
    tokenizer, _ = oracle
    batch = [tokenizer.encode(p) for p in ("one two three", "four five")]
    r = oai.completions.create(model="", prompt=batch, n=3, max_tokens=4, temperature=0,
                               extra_body={"ignore_eos": True})
    assert len(r.choices) == 6
    for i, ids in enumerate(batch):
        alone = oai.completions.create(model="", prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
        assert [c.text for c in r.choices[3 * i: 3 * i + 3]] == [alone] * 3


def test_streaming_with_n_carries_each_choice_index(oai):
    kwargs = dict(model="", prompt=["Cider", "Orchards in spring"], n=2, max_tokens=5, temperature=0.8, seed=3,
                  extra_body={"ignore_eos": True})
    whole = oai.completions.create(**kwargs)
    texts: dict[int, str] = {}
    finishes = {}
    usage = None
    for chunk in oai.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {i: "length" for i in range(4)}
    assert usage.completion_tokens == 20


def test_streamed_echo_matches_the_whole_answer(oai):
    kwargs = dict(model="", prompt=[PROMPT, "Short one"], max_tokens=0, echo=True, logprobs=1, temperature=0)
    whole = oai.completions.create(**kwargs)
    texts: dict[int, str] = {}
    lps: dict[int, list] = {}
    for chunk in oai.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs if c.logprobs else [])
    assert texts == {0: PROMPT, 1: "Short one"} == {c.index: c.text for c in whole.choices}
    for c in whole.choices:  # (float32 sums differ by a few ulps with the batch's shape)
        assert lps[c.index][0] is None is c.logprobs.token_logprobs[0]
        np.testing.assert_allclose(lps[c.index][1:], c.logprobs.token_logprobs[1:], atol=1e-4)


def test_vllm_prompt_logprobs_extension(oai, oracle):
    tokenizer, dense = oracle
    ids = tokenizer.encode(PROMPT)
    r = oai.completions.create(model="", prompt=PROMPT, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    ref = dense(ids)
    for pos, (tok, entry) in enumerate(zip(ids[1:], entries[1:])):
        assert abs(entry[str(tok)]["logprob"] - ref[pos, tok]) < 1e-4
        best = int(np.argmax(ref[pos]))
        assert entry[str(best)]["rank"] == 1


@pytest.mark.parametrize("extra, name", [({"best_of": 2}, "best_of"), ({"suffix": "end"}, "suffix"),
                                         ({"prompt_logprobs": 21}, "prompt_logprobs"),
                                         ({"n": 17}, "n=17")])
def test_refusals_name_the_field(oai, extra, name):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model="", prompt="x", max_tokens=2, extra_body=extra)
    assert name in json.dumps(e.value.body)


def test_bad_prompt_lists_are_400(oai):
    for prompt in ([], [[]], ["a", [1, 2]], [1, "a"]):
        with pytest.raises(openai.BadRequestError, match="prompt"):
            oai.completions.create(model="", prompt=prompt, max_tokens=2)


def test_lm_eval_local_completions_loglikelihood(tiny_worker, tiny_model_dir, oracle):
    """lm-eval's own API model (batch 4, token-id prompts, echo + logprobs + max_tokens=1)
    scores continuations as the dense model does."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    _, dense = oracle
    lm = LocalCompletionsAPI(base_url=f"http://{tiny_worker.http}/v1/completions", model=tiny_model_dir.name,
                             tokenizer=str(tiny_model_dir), tokenizer_backend="huggingface", batch_size=4,
                             max_length=512, num_concurrent=1, max_retries=1)
    pairs = [("The capital of the orchard is", " the old pear tree"), ("Two plus two is", " four"),
             ("Bees fly to", " the blossoms"), ("Apples are", " red"), ("In autumn we press", " cider today")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(requests, disable_tqdm=True)
    assert len(got) == len(pairs)
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        ctx, cont = lm._encode_pair(context, continuation)  # how lm-eval splits the tokens
        whole = ctx + cont
        ref = dense(whole)
        want = sum(ref[len(ctx) + k - 1, t] for k, t in enumerate(cont))
        assert abs(logprob - want) < 1e-3, (context, logprob, want)
        assert greedy == all(int(np.argmax(ref[len(ctx) + k - 1])) == t for k, t in enumerate(cont))


def test_the_sdk_exposes_n_prompt_logprobs_and_echo(tiny_worker, oracle):
    tokenizer, dense = oracle
    with Client(tiny_worker.grpc, timeout=60) as client:
        c = client.generate(PROMPT, max_tokens=3, temperature=0.9, seed=11, n=3, prompt_logprobs=0, echo=True,
                            ignore_eos=True)
        alone = [client.generate(PROMPT, max_tokens=3, temperature=0.9, seed=11 + i, ignore_eos=True).token_ids
                 for i in range(3)]
        chunks = list(client.stream(PROMPT, max_tokens=3, n=2, temperature=0, ignore_eos=True))
    assert [s.index for s in c.choices] == [0, 1, 2]
    assert [s.token_ids for s in c.choices] == alone
    assert all(s.finish_reason == "length" for s in c.choices)
    assert c.usage.completion_tokens == 9
    ids = tokenizer.encode(PROMPT)
    assert c.prompt_token_ids == ids and c.prompt_text == PROMPT
    ref = dense(ids)
    assert np.isnan(c.prompt_logprobs[0].logprob)  # the first prompt token has none
    np.testing.assert_allclose([lp.logprob for lp in c.prompt_logprobs[1:]], ref[np.arange(len(ids) - 1), ids[1:]],
                               atol=1e-4)
    assert sorted({ch.index for ch in chunks}) == [0, 1] and sum(ch.finished for ch in chunks) == 2


MC_DOCS = [
    {"question": "Which fruit grows on an apple tree?", "choices": ["apples", "pears", "stones"], "answer": 0},
    {"question": "Bees make", "choices": ["honey", "cider", "bread", "iron"], "answer": 0},
    {"question": "In autumn the leaves", "choices": ["fall", "sing"], "answer": 1},
    {"question": "The orchard keeper prunes the", "choices": ["trees", "clouds", "rivers"], "answer": 2},
    {"question": "Cider is pressed from", "choices": ["apples", "rocks"], "answer": 0},
]


def test_lm_eval_multiple_choice_task_scores_as_the_dense_model(tiny_worker, tiny_model_dir, oracle, tmp_path,
                                                                 monkeypatch):
    """A multiple-choice task (a local JSON dataset and task YAML written here, no
    download) through `lm_eval.simple_evaluate` with local-completions at batch size 4:
    its accuracy and per-choice loglikelihoods are the dense model's."""
    import lm_eval
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "orchard_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (tmp_path / "orchard_mc.yaml").write_text(f"""
task: orchard_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    lm = LocalCompletionsAPI(base_url=f"http://{tiny_worker.http}/v1/completions", model=tiny_model_dir.name,
                             tokenizer=str(tiny_model_dir), tokenizer_backend="huggingface", batch_size=4,
                             max_length=512, max_retries=1)
    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
    out = lm_eval.simple_evaluate(model=lm, tasks=["orchard_mc"], task_manager=tasks,
                                  log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                  fewshot_random_seed=0)
    _, dense = oracle
    correct = []
    for doc in MC_DOCS:
        scores = []
        for choice in doc["choices"]:
            ctx, cont = lm._encode_pair(doc["question"], " " + choice)
            ref = dense(ctx + cont)
            scores.append(sum(float(ref[len(ctx) + k - 1, t]) for k, t in enumerate(cont)))
        correct.append(int(np.argmax(scores)) == doc["answer"])
        sample = next(s for s in out["samples"]["orchard_mc"] if s["doc"]["question"] == doc["question"])
        got = [r[0] for r in sample["filtered_resps"]]
        np.testing.assert_allclose(got, scores, atol=1e-3)
    assert out["results"]["orchard_mc"]["acc,none"] == pytest.approx(float(np.mean(correct)))
