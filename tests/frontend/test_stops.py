from frontend_svc.stops import StopStrings


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
