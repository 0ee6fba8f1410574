"""logprob_gap: the arithmetic of the quantized path's numerical cost (mean and max
absolute logprob difference, top-1 agreement), both OpenAI logprob shapes, and how a
server's token texts become ids. No server, no model."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from .test_serve_bench import _load

gap_mod = _load("logprob_gap")


def test_gap_pools_every_token_of_every_answer():
    answers = [([-0.1, -0.5], [7, 8], [-0.2, -0.5], [7, 9]),  # diffs 0.1, 0.0
               ([-2.0], [3], [-1.4], [3])]                      # diff 0.6
    result = gap_mod.gap(answers)
    assert result["tokens"] == 3
    assert result["mean_abs_diff"] == pytest.approx(0.7 / 3)
    assert result["max_abs_diff"] == pytest.approx(0.6)
    # the reference's top-1 is the server's choice at 2 of 3 positions (8 vs 9 differs)
    assert result["top1_agreement"] == pytest.approx(2 / 3)


def test_an_exact_server_has_no_gap_and_full_top1_agreement():
    result = gap_mod.gap([([-0.3, -1.0], [1, 2], [-0.3, -1.0], [1, 2])])
    assert result["mean_abs_diff"] == 0 and result["max_abs_diff"] == 0
    assert result["top1_agreement"] == 1


def test_no_answered_token_gives_no_figures_not_a_division_by_zero():
    assert gap_mod.gap([([], [], [], [])])["mean_abs_diff"] is None


def test_both_openai_logprob_shapes_are_read():
    chat = {"content": [{"token": " a", "logprob": -0.5, "id": 12, "top_logprobs": []},
                        {"token": "b", "logprob": -1.5, "top_logprobs": []}]}
    assert gap_mod.parse_logprobs(chat) == [{"token": " a", "id": 12, "logprob": -0.5},
                                            {"token": "b", "id": None, "logprob": -1.5}]
    legacy = {"tokens": [" a", "b"], "token_logprobs": [-0.5, -1.5],
              "top_logprobs": [{}, {}], "text_offset": [0, 2]}
    assert [e["logprob"] for e in gap_mod.parse_logprobs(legacy)] == [-0.5, -1.5]
    assert gap_mod.parse_logprobs(None) == []


def test_tokens_named_by_id_give_their_ids():
    """return_tokens_as_token_ids' names, in both shapes; a text that only looks
    like one stays a text."""
    chat = {"content": [{"token": "token_id:42", "logprob": -0.5, "top_logprobs": []}]}
    assert gap_mod.parse_logprobs(chat) == [{"token": "token_id:42", "id": 42,
                                             "logprob": -0.5}]
    legacy = {"tokens": ["token_id:7", "a token_id:8", "token_id:"],
              "token_logprobs": [-0.5, -1.5, -2.0]}
    assert [e["id"] for e in gap_mod.parse_logprobs(legacy)] == [7, None, None]


def test_token_texts_map_to_the_one_id_that_decodes_to_them_and_stop_where_none_does():
    vocab = {"a": 0, "b": 1, "c": 2, "[UNK]": 3}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    answer = [{"token": "b", "id": None, "logprob": -1.0},
              {"token": "zz", "id": 2, "logprob": -1.0},      # the server's own id wins
              {"token": "a", "id": None, "logprob": -1.0},
              {"token": "\ufffd", "id": None, "logprob": -1.0},  # no single id: stop
              {"token": "c", "id": None, "logprob": -1.0}]
    assert gap_mod.token_ids(tok, answer) == [1, 2, 0]
