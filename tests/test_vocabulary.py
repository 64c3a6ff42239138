"""The grammar engine's vocabulary equals the tokenizer's, id for id (bytes and
specialness), on the layouts real tokenizers have: the BPE first and added tokens after it
(Qwen2.5 / Qwen3 with special then ordinary added tokens, Llama 3, gpt-oss with reserved
ids and a padded embedding), control tokens first (Mistral's Tekken, DeepSeek, with
ordinary <think> tokens among the added ones at the end), and SentencePiece with byte
fallback (Gemma). The oracle is the tokenizer itself (transformers' fast tokenizer):
each token's text in context, the added tokens' contents and flags, and round trips."""

from __future__ import annotations

import functools
import json

import jsonschema
import llguidance
import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from cluster.formats.thinking import ThinkingGrammar
from cluster.modelgen import create_model, synthetic_corpus
from cluster.worker.config import EngineConfig
from cluster.worker.engine import Engine
from cluster.worker.sampling_params import SamplingParams, StructuredOutput
from cluster.worker.structured import allocate_bitmask, tool_call_constraint, with_thinking
from cluster.worker.vocabulary import lltokenizer

S, P = True, False  # an added token special, or plain (ordinary: kept when decoding)
TEKKEN = [("<unk>", S), ("<s>", S), ("</s>", S), ("[INST]", S), ("[/INST]", S), ("[AVAILABLE_TOOLS]", S),
          ("[/AVAILABLE_TOOLS]", S), ("[TOOL_RESULTS]", S), ("[/TOOL_RESULTS]", S), ("[TOOL_CALLS]", S),
          *((f"<SPECIAL_{i}>", S) for i in range(10, 16))]
LAYOUTS = {
    # kind of base vocabulary, tokens before it (also in its vocab), tokens added after it, padding
    "qwen": ("byte", [], [("<|endoftext|>", S), ("<|im_start|>", S), ("<|im_end|>", S), ("<tool_call>", P),
                          ("</tool_call>", P), ("<think>", P), ("</think>", P)], 0),
    "llama3": ("byte", [], [("<|begin_of_text|>", S), ("<|end_of_text|>", S), ("<|reserved_special_token_0|>", S),
                            ("<|finetune_right_pad_id|>", S), ("<|start_header_id|>", S), ("<|end_header_id|>", S),
                            ("<|eom_id|>", S), ("<|eot_id|>", S), ("<|python_tag|>", S)], 0),
    "tekken": ("byte", TEKKEN, [], 0),
    # SentencePiece, as transformers' GemmaConverter writes it: a normalizer turns spaces into "▁"
    "gemma": ("spm", [("<pad>", S), ("<eos>", S), ("<bos>", S), ("<unk>", S), ("<mask>", S), ("[multimodal]", P),
                      ("<start_of_turn>", S), ("<end_of_turn>", S)], [("<start_of_image>", S)], 0),
    # SentencePiece as Llama 2 / Mistral v0.1's tokenizer.json (and Orchard's GGUF import) has it:
    # "▁" prepended, the decoder strips it
    "llama2": ("spm", [("<unk>", S), ("<s>", S), ("</s>", S)], [], 0),
    # SentencePiece through a Metaspace pre-tokenizer (newer converters)
    "metaspace": ("spm", [("<unk>", S), ("<s>", S), ("</s>", S), ("[INST]", S), ("[/INST]", S)], [], 0),
    "gpt-oss": ("byte", [], [("<|startoftext|>", S), ("<|endoftext|>", S), ("<|reserved_200000|>", S),
                             ("<|return|>", S), ("<|constrain|>", S), ("<|channel|>", S), ("<|start|>", S),
                             ("<|end|>", S), ("<|message|>", S), ("<|reserved_200009|>", S), ("<|call|>", S)], 37),
    "deepseek": ("byte", [("<｜begin▁of▁sentence｜>", S), ("<｜end▁of▁sentence｜>", S), ("<｜▁pad▁｜>", S)],
                 [("<｜place▁holder▁no▁0｜>", S), ("<｜User｜>", S), ("<｜Assistant｜>", S), ("<think>", P),
                  ("</think>", P), ("<｜tool▁calls▁begin｜>", S), ("<｜tool▁call▁begin｜>", S), ("<｜tool▁sep｜>", S),
                  ("<｜tool▁call▁end｜>", S), ("<｜tool▁calls▁end｜>", S)], 0),
}
TEXT = "Ünïcödé café — 東京 🍎, tabs\tand  spaces\n{\"a\": [1, 2.5e-3]} <tool_call>{}</tool_call>"


@functools.lru_cache(maxsize=None)
def _trained(kind: str) -> tuple[dict, list]:
    """A small BPE's vocabulary and merges: byte-level (GPT-2's alphabet) or SentencePiece-style."""
    tok = Tokenizer(models.BPE(byte_fallback=kind == "spm"))
    if kind == "byte":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(synthetic_corpus(0, 20_000), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    return model["vocab"], model["merges"]


def build(layout: str) -> tuple[PreTrainedTokenizerFast, int]:
    """A tokenizer in `layout`'s order of ids, and the model's vocabulary size (padded past it)."""
    kind, before, after, padding = LAYOUTS[layout]
    vocab, merges = _trained(kind)
    pieces = sorted(vocab, key=vocab.get)
    if kind == "spm":  # byte fallback's pieces come right after the control tokens, as in Gemma
        pieces = [f"<0x{b:02X}>" for b in range(256)] + pieces
    ids = {content: i for i, (content, _) in enumerate(before)}
    ids.update({piece: len(before) + i for i, piece in enumerate(pieces)})
    tok = Tokenizer(models.BPE(vocab=ids, merges=[tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                                                  for m in merges], byte_fallback=kind == "spm"))
    if kind == "byte":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    else:
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if layout == "metaspace":
            tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
        elif layout == "gemma":
            tok.normalizer = normalizers.Replace(" ", "\u2581")
        else:
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
            steps.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(steps)
    for content, special in before + after:
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    for content, _ in before:
        assert tok.token_to_id(content) == ids[content]  # kept where the vocabulary has it
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=(before + after)[1][0])
    return hf, tok.get_vocab_size() + padding


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_vocabulary_equals_the_tokenizers_id_for_id(layout):
    hf, n_vocab = build(layout)
    llt = lltokenizer(hf, n_vocab)
    assert llt.vocab_size == n_vocab
    added = hf.backend_tokenizer.get_added_tokens_decoder()
    special = {i for i, t in added.items() if t.special}
    # llguidance marks special tokens with a leading 0xFF byte, so the byte-level piece of
    # byte 0xFF reads as special too: harmless, no UTF-8 text contains that byte
    lone_ff = {i for i in range(len(hf)) if i not in added and hf.decode([i]).encode() == "\ufffd".encode()
               and _ff_piece(hf, i)}
    assert {i for i in range(n_vocab) if llt.is_special_token(i)} == special | lone_ff
    for i, t in added.items():
        assert llt.decode_bytes([i]) == t.content.encode(), (i, t.content)
    # every other token: its text in context, as the tokenizer's own decoder writes it
    anchor = hf.convert_tokens_to_ids("a" if LAYOUTS[layout][0] == "byte" else "\u2581a")
    checked = 0
    for i in range(len(hf)):
        if i in added:
            continue
        text = hf.decode([anchor, i])[len(hf.decode([anchor])):]
        if "\ufffd" not in text:  # a piece of a multi-byte character has no text alone
            assert llt.decode_bytes([i]) == text.encode(), (i, hf.convert_ids_to_tokens(i), text)
            checked += 1
    assert len(hf) - len(added) - checked <= 128  # at most the lone bytes 0x80-0xFF: the round trip below
    if n_vocab > len(hf):  # the embedding's padding: no text, never allowed
        assert _allowed(llt, r'start: /(.|\n)*/', n_vocab) & set(range(len(hf), n_vocab)) == set()
    ids = hf.encode(TEXT, add_special_tokens=False)
    prefix = " " if layout == "llama2" else ""  # the "▁" the normalizer put before the text is a space
    assert b"".join(llt.decode_bytes([i]) for i in ids) == (prefix + TEXT).encode()


def _allowed(llt, lark: str, n_vocab: int) -> set[int]:
    """The ids a grammar allows first."""
    matcher = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(lark))
    mask = allocate_bitmask(1, n_vocab)
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    return set(np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:n_vocab]).tolist())


def _ff_piece(hf, i: int) -> bool:
    piece = hf.convert_ids_to_tokens(i)
    return piece.startswith("\u00ff") or piece == "<0xFF>"


@pytest.mark.parametrize("layout", ["qwen", "deepseek", "gemma", "llama2"])
def test_a_grammars_literal_marker_is_the_marker_token(layout):
    """A plain added token's text in a grammar allows that token, and no special one."""
    hf, n_vocab = build(layout)
    llt = lltokenizer(hf, n_vocab)
    added = hf.backend_tokenizer.get_added_tokens_decoder()
    for i, t in added.items():
        if t.special:
            continue
        allowed = _allowed(llt, f'start: "{t.content}"', n_vocab)
        assert i in allowed and not allowed & {j for j, s in added.items() if s.special}, (t.content, allowed)


@pytest.fixture(scope="module")
def qwen_engine(tmp_path_factory):
    """A Qwen3 model whose tokenizer has Qwen's layout: BPE, then <|endoftext|> <|im_start|>
    <|im_end|> (special), then <tool_call> ... <think> </think> (ordinary)."""
    path = create_model(tmp_path_factory.mktemp("qwen-layout") / "m", "qwen3", "tiny", seed=3, chat="qwen3")
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    first_special = min(t["id"] for t in added if t["special"])
    assert all(t["id"] > first_special for t in added if not t["special"])  # the layout under test
    return Engine.from_pretrained(path, EngineConfig(num_kv_blocks=128, max_model_len=1024))


def _generate(engine, params: list[SamplingParams]) -> list[list[int]]:
    prompt = engine.tokenizer.encode("Answer with a call, please.")
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", prompt, p)
    tokens = {f"r{i}": [] for i in range(len(params))}
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
    return list(tokens.values())


def test_qwen_layout_thinking_then_json_uses_the_marker_tokens(qwen_engine):
    tok = qwen_engine.tokenizer
    think, end_think = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    spec = with_thinking(StructuredOutput("json_schema", json.dumps(schema)),
                         ThinkingGrammar('"<think>"', '"</think>"', open=False, optional=False))
    # a random model thinks for ever: a bias on </think> ends its thinking soon
    params = [SamplingParams(max_tokens=300, temperature=1.0, seed=s, structured=spec, logit_bias={end_think: 50.0})
              for s in range(3)]
    for out in _generate(qwen_engine, params):
        assert out[0] == think and end_think in out, out
        answer = tok.decode(out[out.index(end_think) + 1:], skip_special_tokens=True)
        jsonschema.validate(json.loads(answer), schema)


def test_qwen_layout_forced_tool_call_uses_the_marker_tokens(qwen_engine):
    tok = qwen_engine.tokenizer
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["a"], "additionalProperties": False}}}]
    spec = tool_call_constraint(tools, "required", ("<tool_call>\n", "\n</tool_call>"))
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, structured=spec) for s in range(3)]
    opening, closing = tok.convert_tokens_to_ids("<tool_call>"), tok.convert_tokens_to_ids("</tool_call>")
    for out in _generate(qwen_engine, params):
        assert out[0] == opening and closing in out, out
        call = json.loads(tok.decode(out[1:out.index(closing)]))
        assert call["name"] == "add" and 0 <= call["arguments"]["a"] <= 9


def test_a_model_without_an_end_token_is_refused_by_name():
    from cluster.worker.structured import GrammarCompiler, InvalidGrammar

    hf, n_vocab = build("llama2")
    hf.eos_token = None
    with pytest.raises(InvalidGrammar, match="end-of-sequence"):
        GrammarCompiler(hf, n_vocab).compile(StructuredOutput("regex", "a+"))
