"""Seconds and bytes as people read them, the one formatter every view of a plan prints with
(:mod:`autoparallel.summary`, :mod:`autoparallel.explain`, :mod:`autoparallel.plot`,
``plan.table()``, the recipes' comparison, the records' reprs, error messages).

Three significant digits, the unit chosen by magnitude: ``ns``, ``µs``, ``ms``, ``s`` for
seconds; ``B``, ``KiB``, ``MiB``, ``GiB``, ``TiB`` (powers of 1024) for bytes. A value that
rounds up to 1000 of a unit takes the next one (``999.7 ms`` prints ``1 s``), so a column of
mixed magnitudes never shows ``0.01072 s`` beside ``9.791 ms``.
"""

from __future__ import annotations

_TIME = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))
_BYTES = (("TiB", 2.0 ** 40), ("GiB", 2.0 ** 30), ("MiB", 2.0 ** 20), ("KiB", 2.0 ** 10), ("B", 1.0))


def seconds(t: float, sign: bool = False) -> str:
    """``t`` seconds as text: ``"10.7 ms"``, ``"4.71 s"``, ``"53.7 µs"``; ``"+1.2 ms"`` with
    ``sign`` (a difference)."""
    return _text(t, _TIME, sign)


def nbytes(n: float, sign: bool = False) -> str:
    """``n`` bytes as text: ``"35.2 MiB"``, ``"1 KiB"``, ``"512 B"``; ``"-3 MiB"`` with ``sign``
    (a difference)."""
    return _text(n, _BYTES, sign)


def time_unit(t: float) -> tuple[str, float]:
    """``(name, seconds per unit)`` of the unit :func:`seconds` prints ``t`` in, for a plot's axis."""
    return _TIME[_unit(abs(t), _TIME)]


def bytes_unit(n: float) -> tuple[str, float]:
    """``(name, bytes per unit)`` of the unit :func:`nbytes` prints ``n`` in, for a plot's axis."""
    return _BYTES[_unit(abs(n), _BYTES)]


def _unit(x: float, units: tuple[tuple[str, float], ...]) -> int:
    """The index in ``units`` (largest first) of the largest unit leaving ``x`` (≥ 0) at least 1
    once rounded to three digits; the smallest below 1; the unit of scale 1 for zero."""
    if x == 0:
        return next(k for k, (_, scale) in enumerate(units) if scale == 1)
    k = next((i for i, (_, scale) in enumerate(units) if x >= scale), len(units) - 1)
    if k > 0 and float(f"{x / units[k][1]:.3g}") >= 1000:  # rounds up into the next unit
        k -= 1
    return k


def _text(x: float, units: tuple[tuple[str, float], ...], sign: bool) -> str:
    """``x`` in its unit (:func:`_unit`) with three significant digits, no exponent."""
    prefix = "-" if x < 0 else "+" if sign else ""
    name, scale = units[_unit(abs(x), units)]
    v = abs(x) / scale
    return f"{prefix}{v:.0f} {name}" if v >= 1000 else f"{prefix}{v:.3g} {name}"
