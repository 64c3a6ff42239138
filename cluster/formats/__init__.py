"""Model families' formats, one home per family: how a family's models write tool calls
(markers, parser, the grammar that forces one), mark their thinking, and (for the models
`orchard model create` makes) their chat templates and special tokens. Nothing here imports
MLX or llguidance.

Contract
--------
- One module per family, or per format several families share (`mistral.py`,
  `deepseek.py`, `harmony.py`, `think.py` for <think> tags, `hermes.py` for the formats
  mlx-lm parses, ...), exporting `FAMILY`: a `Family` (family.py) whose `calls(template,
  vocab, mlx_lm)` and `reasoning(template, vocab)` say whether a model is of it, and return
  its `CallFormat` (calls.py) and `ReasoningFormat` (thinking.py).
  The module also holds the family's chat formats for `orchard model create` (`ChatFormat`,
  chat.py; plain.py for families with nothing else here) and its `REAL_FORMATS`, the real
  templates in chat_templates/.
- `registry.FAMILIES` is the one table: `registry.call_format` and
  `registry.reasoning_format` ask its rows in order. Adding a family is one module and one
  row (tests/test_formats.py adds a made-up one). The registry also maps model types and
  names to the chat formats `orchard model create` writes.
- The generic machinery reads only those records: `ToolCallStream` (calls.py) cuts calls out
  of the output, `ThinkStream` (thinking.py) the thinking, `make_splitter` (split.py) runs
  both; a family with a stream of its own (harmony) names it in its `ReasoningFormat`.
  A call grammar is built of grammar.py's parts; cluster/worker/structured.py compiles it.
- cluster/api/ keeps what the API defines: tool schemas and choices checked, chat history
  for a template, a response chunk split by a splitter (cluster/api/tools.py).
"""
