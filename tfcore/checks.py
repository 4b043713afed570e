"""Input validation shared by every op: each error names the argument, what it got and what was expected."""
from __future__ import annotations

from .backend import FLOAT_DTYPES, namespace


def dtype_name(x) -> str:
    """'float64' for NumPy, CuPy and array-api-strict alike (the last prints 'array_api_strict.float64')."""
    return str(x.dtype).rsplit(".", 1)[-1]


def float_inputs(**arrays):
    """Every named array (None entries skipped) is float32 or float64, all of the same dtype."""
    named = {k: v for k, v in arrays.items() if v is not None}
    for name, x in named.items():
        if not hasattr(x, "dtype") or not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if dtype_name(x) not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32 or float64, got {dtype_name(x)}")
    dtypes = {name: dtype_name(x) for name, x in named.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in dtypes.items())
        raise TypeError(f"inputs must share one float dtype, got {listed}")
    namespace(*named.values())  # one library, or a clear TypeError


def ndim(name: str, x, expected: int | tuple[int, ...]):
    allowed = (expected,) if isinstance(expected, int) else expected
    if x.ndim not in allowed:
        want = " or ".join(str(n) for n in allowed)
        raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(x.shape)}")


def min_ndim(name: str, x, least: int):
    if x.ndim < least:
        raise ValueError(f"{name} must have at least {least} dimension(s), got shape {tuple(x.shape)}")


def shape(name: str, x, expected: tuple):
    """x.shape equals `expected`; a None entry in `expected` matches any size."""
    got = tuple(x.shape)
    if len(got) != len(expected) or any(e is not None and g != e for g, e in zip(got, expected)):
        want = "(" + ", ".join("*" if e is None else str(e) for e in expected) + (",)" if len(expected) == 1 else ")")
        raise ValueError(f"{name} must have shape {want}, got {got}")


def integer_ids(name: str, ids, high: int, *, allowed: int | None = None):
    """ids is an integer array with every entry in [0, high) (or equal to `allowed`)."""
    xp = namespace(ids)
    if not xp.isdtype(ids.dtype, "integral"):
        raise TypeError(f"{name} must be an integer array, got {dtype_name(ids)}")
    if ids.size == 0:
        return
    wide = xp.astype(ids, xp.int64, copy=False)  # uint8 ids cannot even be compared with -100 or 256
    bad = (wide < 0) | (wide >= high)
    if allowed is not None:
        bad = bad & (wide != allowed)
    if bool(xp.any(bad)):
        first = int(xp.reshape(wide, (-1,))[int(xp.argmax(xp.astype(xp.reshape(bad, (-1,)), xp.int8)))])
        extra = f" (or {allowed} to ignore)" if allowed is not None else ""
        raise ValueError(f"{name} must lie in [0, {high}){extra}, found {first}")


def positive(name: str, value: float):
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
