from frontend_svc.request.stops import StopStrings


def test_stop_found_when_it_spans_the_boundary_of_new_text():
    stops = StopStrings(["STOP"])
    assert stops.find("abcST", 2) is None
    match = stops.find("abcSTOP", 2)
    assert match is not None and match.index == 3 and match.stop == "STOP"


def test_earliest_of_several_stops_wins():
    stops = StopStrings(["world", "lo w"])
    match = stops.find("hello world", 11)
    assert match.stop == "lo w" and match.index == 3


def test_text_already_checked_is_not_searched_again():
    stops = StopStrings(["ab"])
    assert stops.find("ab" + "xyz", 3) is None


def test_holdback_is_the_longest_suffix_that_starts_a_stop():
    stops = StopStrings(["\n\nUser:", "END"])
    assert stops.holdback("hello\n\nUs") == 4
    assert stops.holdback("hello E") == 1
    assert stops.holdback("hello") == 0
    assert StopStrings([]).holdback("abc") == 0


def test_holdback_matches_the_quadratic_definition_on_random_text():
    import random
    rng = random.Random(7)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        expected = max((k for s in stops for k in range(min(len(s) - 1, len(text)) + 1)
                        if k == 0 or text.endswith(s[:k])), default=0)
        assert StopStrings(stops).holdback(text) == expected, (stops, text)


def test_holdback_fed_piece_by_piece_matches_the_definition():
    import random
    rng = random.Random(11)
    for _ in range(200):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 3))]
        matcher, text = StopStrings(stops), ""
        for _ in range(rng.randint(1, 8)):
            text += "".join(rng.choice("ab") for _ in range(rng.randint(0, 4)))
            expected = max((k for s in stops for k in range(min(len(s) - 1, len(text)) + 1)
                            if k == 0 or text.endswith(s[:k])), default=0)
            assert matcher.holdback(text) == expected, (stops, text)


def test_holdback_work_per_token_does_not_grow_with_stops_or_text():
    import time
    stops = StopStrings(["a" * 255 + "b"] * 16)  # the hostile case: every char half-matches
    text = "a" * 300
    assert stops.holdback(text) == 255
    t0 = time.perf_counter()
    for _ in range(2000):  # a token at a time: only the new characters are scanned
        text += "aa"
        assert stops.holdback(text) == 255
    per_token_s = (time.perf_counter() - t0) / 2000
    assert per_token_s < 1e-3, per_token_s
