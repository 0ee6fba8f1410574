"""The generated modules in shared/proto/ match protos/ exactly."""

from shared.proto import gen


def test_generated_modules_match_protos():
    assert gen.stale_files() == [], "run: python -m shared.proto.gen"


def test_generated_imports_do_not_reference_the_gapserve_package():
    # `from gapserve.v1 import` would resolve to our CLI package and fail.
    for text in gen.committed().values():
        assert "from gapserve" not in text
