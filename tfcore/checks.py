"""Input validation shared by every op: each error names the argument, what it got and what was expected.

Every check raises TypeError (wrong kind of object, dtype or library) or ValueError (right kind,
wrong shape or value), with a message that starts with the argument's name.
"""
from __future__ import annotations

import math
import numbers
import operator

import numpy as np

from .backend import FLOAT_DTYPES, namespace


def dtype_name(x) -> str:
    """'float64' for NumPy, CuPy and array-api-strict alike (the last prints 'array_api_strict.float64')."""
    return str(x.dtype).rsplit(".", 1)[-1]


def _library(x) -> str:
    """'numpy.ndarray', 'array_api_strict._array_object.Array', 'builtins.list', ..."""
    return type(x).__module__ + "." + type(x).__name__


def array(name: str, x):
    """x is an array of an array-API library (not a list, a number or a masked array)."""
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{name}: masked arrays are not supported, pass {name}.filled(...) or {name}.data"
        )
    if not hasattr(x, "dtype") or not hasattr(x, "shape") or isinstance(x, np.generic):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")


def same_library(**arrays):
    """Every named array (None skipped) comes from one library; returns its namespace."""
    named = {k: v for k, v in arrays.items() if v is not None}
    try:
        return namespace(*named.values())
    except TypeError as err:
        listed = ", ".join(f"{k}={_library(v)}" for k, v in named.items())
        raise TypeError(
            f"inputs must be arrays of one library, got {listed}; "
            "move them with tfcore.backend.asarray first"
        ) from err


def float_inputs(**arrays):
    """Every named array (None skipped) is float32 or float64, all of one dtype and one library.

    Returns the arrays' namespace.
    """
    named = {k: v for k, v in arrays.items() if v is not None}
    for name, x in named.items():
        array(name, x)
        if dtype_name(x) not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32 or float64, got {dtype_name(x)}")
    dtypes = {name: dtype_name(x) for name, x in named.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{k}={v}" for k, v in dtypes.items())
        raise TypeError(f"inputs must share one float dtype, got {listed}")
    return same_library(**named)


def ndim(name: str, x, expected: int | tuple[int, ...]):
    allowed = (expected,) if isinstance(expected, int) else expected
    if x.ndim not in allowed:
        want = " or ".join(str(n) for n in allowed)
        raise ValueError(f"{name} must have {want} dimensions, got shape {tuple(x.shape)}")


def min_ndim(name: str, x, least: int):
    if x.ndim < least:
        raise ValueError(f"{name} must have at least {least} dimension(s), got shape {tuple(x.shape)}")


def width(name: str, x, what: str = "width") -> int:
    """x has at least one axis and a last axis (its `what`) of nonzero size; returns that size.

    An empty batch (a zero-size leading axis) is fine and gives an empty result; a zero
    width is an error, because a row of no entries has no mean, softmax or norm.
    """
    min_ndim(name, x, 1)
    size = int(x.shape[-1])
    if size == 0:
        raise ValueError(
            f"{name} must have a nonzero last axis ({what}), got shape {tuple(x.shape)}"
        )
    return size


def shape(name: str, x, expected: tuple):
    """x.shape equals `expected`; a None entry in `expected` matches any size."""
    got = tuple(x.shape)
    if len(got) != len(expected) or any(e is not None and g != e for g, e in zip(got, expected)):
        inner = ", ".join("*" if e is None else str(e) for e in expected)
        want = "(" + inner + (",)" if len(expected) == 1 else ")")
        raise ValueError(f"{name} must have shape {want}, got {got}")


def integer_ids(name: str, ids, high: int, *, allowed: int | None = None):
    """ids is an integer array with every entry in [0, high) (or equal to `allowed`).

    Unsigned ids are compared in their own dtype, so a uint64 id beyond the int64 range is
    reported as itself rather than as the negative number a cast would make of it.
    """
    array(name, ids)
    xp = same_library(**{name: ids})
    if not xp.isdtype(ids.dtype, "integral"):
        raise TypeError(f"{name} must be an integer array, got {dtype_name(ids)}")
    if ids.size == 0:
        return
    if xp.isdtype(ids.dtype, "unsigned integer"):
        top = xp.iinfo(ids.dtype).max                # compare only with numbers the dtype holds
        if high > top:
            return
        bad = ids >= high
        if allowed is not None and 0 <= allowed <= top:
            bad = bad & (ids != allowed)
    else:
        wide = xp.astype(ids, xp.int64, copy=False)  # uint8 cannot even be compared with -100
        bad = (wide < 0) | (wide >= high)
        if allowed is not None:
            bad = bad & (wide != allowed)
    if bool(xp.any(bad)):
        flat_bad = xp.astype(xp.reshape(bad, (-1,)), xp.int8)
        first = int(xp.reshape(ids, (-1,))[int(xp.argmax(flat_bad))])
        extra = f" (or {allowed} to ignore)" if allowed is not None else ""
        raise ValueError(f"{name} must lie in [0, {high}){extra}, found {first}")


# --------------------------------------------------------------------------------------
# Settings: plain Python numbers, names and dtypes


def integer(name: str, value, *, least: int | None = None) -> int:
    """A Python (or NumPy) integer, not a bool or a float; at least `least` if given."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if least is not None and value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")
    return value


def real(name: str, value) -> float:
    """A real Python (or NumPy) number, not a bool, an array or a string."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    return float(value)


def positive(name: str, value) -> float:
    """A finite number > 0 (an eps, a base): inf and nan are rejected too."""
    value = real(name, value)
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def nonnegative(name: str, value) -> float:
    """A finite number >= 0 (a clipping norm or a temperature, where 0 turns a thing off):
    inf and nan are rejected too."""
    value = real(name, value)
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def probability(name: str, value) -> float:
    """A number in [0, 1) (a dropout probability)."""
    value = real(name, value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"dropout probability {name} must lie in [0, 1), got {value}")
    return value


def generator(name: str, rng):
    """A random generator from tfcore.backend.default_rng(seed), which dropout in training
    needs; an int seed is refused: re-seeding at every call would repeat one mask."""
    if rng is None:
        raise ValueError(f"dropout in training needs an {name}: pass "
                         "tfcore.backend.default_rng(seed)")
    if not callable(getattr(rng, "random", None)):
        raise TypeError(
            f"{name} must be a generator from tfcore.backend.default_rng(seed), got "
            f"{type(rng).__name__} {rng!r} (a seed would repeat one mask at every call)"
        )
    return rng


def boolean(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def choice(name: str, value, allowed: tuple):
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return value


def float_dtype(name: str, dtype, xp):
    """The float dtype of namespace `xp` named by `dtype`.

    Accepted: 'float32' / 'float64', the namespace's own xp.float32 / xp.float64, and NumPy's
    np.float32 / np.float64 (types or np.dtype objects). Anything else is a TypeError.
    """
    text = None
    if isinstance(dtype, str):
        text = dtype
    elif isinstance(dtype, (type, np.dtype)):       # np.float32, np.dtype("float32")
        try:
            text = np.dtype(dtype).name
        except TypeError:
            text = None
    elif isinstance(dtype, type(xp.float64)):        # the backend's own dtype objects
        text = next((n for n in FLOAT_DTYPES if dtype == getattr(xp, n)), None)
    if text not in FLOAT_DTYPES:
        shown = dtype if isinstance(dtype, str) else getattr(dtype, "__name__", dtype)
        raise TypeError(
            f"{name} must be 'float32' or 'float64' (or the backend's float32 / float64), "
            f"got {shown!r}"
        )
    return getattr(xp, text)


# --------------------------------------------------------------------------------------
# Upstream gradients in backward passes


def upstream(name: str, dout, like_shape: tuple, like_dtype, like_namespace):
    """A backward's upstream gradient matches what its forward produced: shape, dtype, library.

    `like_*` are recorded by the forward (its output's shape, dtype and array namespace).
    A gradient of the right size in the wrong layout, or one that would broadcast, is an error.
    """
    array(name, dout)
    got_ns = same_library(**{name: dout})
    if got_ns is not like_namespace:
        raise TypeError(
            f"{name} must be an array of the forward's library "
            f"({like_namespace.__name__.removeprefix('array_api_compat.')}), "
            f"got {_library(dout)}"
        )
    want_shape = tuple(like_shape)
    if tuple(dout.shape) != want_shape:
        raise ValueError(
            f"{name} must have shape {want_shape} like the forward's output, "
            f"got {tuple(dout.shape)}"
        )
    if dout.dtype != like_dtype:
        raise TypeError(
            f"{name} must have dtype {str(like_dtype).rsplit('.', 1)[-1]} like the forward's "
            f"output, got {dtype_name(dout)}"
        )


def upstream_like(name: str, dout, like):
    """`upstream` with shape, dtype and library taken from the array `like` (a cached output)."""
    upstream(name, dout, tuple(like.shape), like.dtype, namespace(like))


def scalar_upstream(name: str, dout) -> float:
    """The upstream gradient of a scalar loss: a Python real number or a 0-d float array.

    The value is used as a Python float, so a 0-d array of any library is accepted.
    """
    if isinstance(dout, np.ma.MaskedArray):
        array(name, dout)
    if isinstance(dout, numbers.Real) and not isinstance(dout, (bool, np.bool_)):
        return float(dout)
    if hasattr(dout, "shape") and hasattr(dout, "dtype"):
        if tuple(dout.shape) != ():
            raise ValueError(
                f"{name} must be a scalar (a number or a 0-d array) because the loss is a scalar, "
                f"got shape {tuple(dout.shape)}"
            )
        if dtype_name(dout) not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32 or float64, got {dtype_name(dout)}")
        return float(dout)
    raise TypeError(
        f"{name} must be a scalar (a number or a 0-d array), got {type(dout).__name__}"
    )
