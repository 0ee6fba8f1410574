"""docs/flags.md is generated from the flag declarations (shared/config.py), so the
page and the parsers cannot disagree."""

from shared import flags_doc


def test_docs_flags_md_is_what_the_declarations_generate():
    assert flags_doc.PATH.read_text() == flags_doc.render(), \
        "docs/flags.md is stale: run `python -m shared.flags_doc`"
