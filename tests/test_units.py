"""The one formatter of seconds and bytes (autoparallel/units.py)."""

import pytest

from autoparallel import units


@pytest.mark.parametrize("t, text", [
    (0.01072, "10.7 ms"), (0.009791, "9.79 ms"), (5.37e-05, "53.7 µs"), (4.71, "4.71 s"), (2.5e-9, "2.5 ns"),
    (0.9997, "1 s"), (0.0009996, "1 ms"), (0.0, "0 s"), (1234.5, "1234 s"), (1.0, "1 s"),
])
def test_seconds_three_digits_unit_by_magnitude(t, text):
    assert units.seconds(t) == text


@pytest.mark.parametrize("n, text", [
    (1024, "1 KiB"), (512, "512 B"), (1000, "0.977 KiB"), (35.2 * 2**20, "35.2 MiB"), (72 * 2**30, "72 GiB"),
    (3 * 2**40, "3 TiB"), (0, "0 B"), (2**30 - 1, "1 GiB"), (1024 ** 5, "1024 TiB"),
])
def test_bytes_three_digits_unit_by_magnitude(n, text):
    assert units.nbytes(n) == text


def test_differences_carry_their_sign():
    assert units.seconds(1.2e-3, sign=True) == "+1.2 ms"
    assert units.seconds(-1.2e-3, sign=True) == "-1.2 ms"
    assert units.seconds(-1.2e-3) == "-1.2 ms"
    assert units.nbytes(-3 * 2**20, sign=True) == "-3 MiB"
    assert units.nbytes(0, sign=True) == "+0 B"


def test_axis_units_are_the_printed_ones():
    assert units.bytes_unit(100 * 2**20) == ("MiB", 2**20) and units.bytes_unit(0) == ("B", 1)
    assert units.time_unit(4.7e-3) == ("ms", 1e-3) and units.time_unit(0.9997) == ("s", 1.0)
