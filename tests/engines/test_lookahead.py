"""The look-ahead loop launches step s + 1 before it reads step s, except after a step that must
settle, and reads every step once, in order."""

from engines.lookahead import lookahead_steps


def _events(start, total, settle_at):
    log = []
    out = list(lookahead_steps(start, total, lambda s: log.append(("launch", s)) or s,
                               lambda s, h: log.append(("read", s)) or h, lambda s: s in settle_at))
    return log, out


def test_every_step_is_read_once_in_order():
    _, out = _events(3, 11, {5, 10})
    assert out == list(range(3, 11))


def test_a_step_is_read_after_the_next_one_is_launched():
    log, _ = _events(0, 6, {5})
    for s in range(5):
        assert log.index(("launch", s + 1)) < log.index(("read", s))


def test_a_settling_step_is_read_before_anything_else_is_launched():
    log, _ = _events(0, 8, {2, 5})
    for s in (2, 5):
        assert log.index(("read", s)) < log.index(("launch", s + 1))


def test_the_last_step_is_read_without_a_settle():
    log, out = _events(0, 3, set())
    assert out == [0, 1, 2] and log[-1] == ("read", 2)
