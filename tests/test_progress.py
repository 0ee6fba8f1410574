"""shared/progress.py: a long step shows that it moves, and how long it took."""

import io

from shared.progress import Progress


def test_a_log_gets_a_line_every_ten_percent_and_the_duration():
    out = io.StringIO()
    with Progress("converting x.gguf", 272, stream=out) as p:
        for _ in range(272):
            p.advance()
    lines = out.getvalue().splitlines()
    assert lines[0] == "gapserve: converting x.gguf: 0%"
    assert [line.rsplit(" ", 1)[1] for line in lines[1:-1]] == [f"{n}%" for n in range(10, 101, 10)]
    assert lines[-1].startswith("gapserve: converting x.gguf: done in ")


def test_a_failed_step_says_so():
    out = io.StringIO()
    try:
        with Progress("converting", 3, stream=out) as p:
            p.advance()
            raise ValueError("bad tensor")
    except ValueError:
        pass
    assert "converting: failed in " in out.getvalue().splitlines()[-1]


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_one_redrawn_bar():
    out = Tty()
    with Progress("converting", 4, stream=out) as p:
        for _ in range(4):
            p.advance()
    text = out.getvalue()
    assert text.count("\n") == 2  # the finished bar, then the duration
    assert "[" + "#" * 30 + "] 100%" in text
