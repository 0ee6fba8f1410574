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


def test_holdback_work_per_token_does_not_grow_with_the_text():
    """The hostile case (every character half-matches 16 stops of 256 characters), a
    token at a time: only the new characters are scanned, so 200 tokens after 100,000
    characters cost what 200 tokens after 300 do. Compared within the test (best of
    five each), not against a clock: a loaded machine slows both alike; a rescan of
    the text would make the long case hundreds of times slower."""
    import time

    def two_hundred_tokens_after(prefix_len: int) -> float:
        best = float("inf")
        for _ in range(5):
            stops = StopStrings(["a" * 255 + "b"] * 16)
            text = "a" * prefix_len
            assert stops.holdback(text) == 255  # the prefix is scanned once, untimed
            t0 = time.thread_time()
            for _ in range(200):
                text += "aa"
                assert stops.holdback(text) == 255
            best = min(best, time.thread_time() - t0)
        return best

    short, long = two_hundred_tokens_after(300), two_hundred_tokens_after(100_000)
    assert long < 10 * short + 0.01, (short, long)
