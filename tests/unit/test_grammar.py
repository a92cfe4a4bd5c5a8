"""The grammar mask, row by row, against an oracle read off the vocabulary: under the regex ``[ab]{1,4}``
the first token may be exactly the tokens whose text is 1 to 4 of the letters a and b."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from tiny_models import make_tokenizer

from mmlora.engine.grammar import GrammarCompiler, GrammarMasks, apply_grammar_masks

pytest.importorskip("xgrammar")


def test_mask_applies_only_to_constrained_rows_and_matches_the_vocabulary(tmp_path):
    tok = make_tokenizer(tmp_path)
    vocab = len(tok)
    compiler = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    rows = [
        SimpleNamespace(grammar=None),
        SimpleNamespace(grammar=compiler.state_for(("regex", "[ab]{1,4}"))),
        SimpleNamespace(grammar=None),
        SimpleNamespace(grammar=compiler.state_for(("regex", "[ab]{1,4}"))),
    ]
    logits = torch.randn(len(rows), vocab)
    before = logits.clone()
    apply_grammar_masks(logits, rows, GrammarMasks(vocab))
    texts = [tok.decode([t]) for t in range(vocab)]
    expected = {
        t for t, s in enumerate(texts) if re.fullmatch("[ab]{1,4}", s) and t not in tok.all_special_ids
    }
    assert expected  # the byte alphabet has a and b at least
    for i in (0, 2):
        assert torch.equal(logits[i], before[i])
    for i in (1, 3):
        allowed = set(torch.isfinite(logits[i]).nonzero()[:, 0].tolist())
        assert allowed == expected
        assert torch.equal(logits[i, sorted(allowed)], before[i, sorted(allowed)])


def test_accept_reports_completion_and_compile_errors_name_the_field(tmp_path):
    tok = make_tokenizer(tmp_path)
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    state = compiler.state_for(("regex", "ab"))
    ids = tok("ab", add_special_tokens=False)["input_ids"]
    assert [state.accept(t) for t in ids] == [False] * len(ids)
    assert state.accept(tok.eos_token_id)
    assert compiler.compile("regex", "ab") is compiler.compile("regex", "ab")  # cached
    with pytest.raises(ValueError, match=r"sampling_params\.json_schema: not valid JSON"):
        compiler.compile("json_schema", "{")
    with pytest.raises(ValueError, match=r"sampling_params\.ebnf: cannot be compiled"):
        compiler.compile("ebnf", "root ::= undefined_rule")
