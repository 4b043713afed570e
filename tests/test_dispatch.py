"""The one dispatch seat, tfcore.ops, and the import graph around it.

* tfcore.functional (the reference) and tfcore.models import no kernels and name none, at
  any level: the models reach a kernel through tfcore.ops only;
* tfcore.kernels imports nothing of tfcore.functional at module level, and tfcore.ops never
  imports tfcore.kernels at module level: no import circle through them;
* for every registered op, tfcore.ops calls the kernel where its predicate holds and the
  reference otherwise, with the same results (float64 to 1e-12, float32 to its precision)
  and the same errors for bad input.
"""
from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tfcore import backend, kernels, ops, optim
from tfcore import functional as F

PACKAGE = Path(__file__).resolve().parents[1] / "tfcore"
# the mark the last lines of functional that called a kernel carried (gone with them)
MARK = "# dispatch: moves to ops"


def _modules(folder):
    return sorted((PACKAGE / folder).glob("*.py"))


def _module_level_imports(tree):
    """Import statements outside any function or class body: (module, names, line)."""
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                  ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, (), child.lineno) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                module = "." * child.level + (child.module or "")
                found.append((module, tuple(a.name for a in child.names), child.lineno))
            visit(child)

    visit(tree)
    return found


def _imports_kernels(module, names):
    """True when `from .. import kernels`, `from ..kernels import x`, `import tfcore.kernels`."""
    if module in ("tfcore.kernels",) or module.startswith(("tfcore.kernels.", "..kernels")):
        return True
    return module in ("..", "tfcore") and "kernels" in names


def _lines_reaching_kernels(path):
    """The lines of a module that import tfcore.kernels (at any level, in a function too)
    or name `kernels`: 'file:line: text'."""
    text = path.read_text()
    lines, reaching = text.splitlines(), set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if _imports_kernels(module, tuple(a.name for a in node.names)):
                reaching.add(node.lineno)
        elif isinstance(node, ast.Import):
            if any(_imports_kernels(a.name, ()) for a in node.names):
                reaching.add(node.lineno)
        elif isinstance(node, (ast.Name, ast.Attribute)) and "kernels" in (
                getattr(node, "id", None), getattr(node, "attr", None)):
            reaching.add(node.lineno)
    return [f"{path.name}:{n}: {lines[n - 1].strip()}" for n in sorted(reaching)]


# -- the import graph ---------------------------------------------------------------------

@pytest.mark.parametrize("folder", ["functional", "models"])
def test_the_reference_and_the_models_reach_no_kernel_but_through_ops(folder):
    """functional is the reference only, and a model reaches a kernel through tfcore.ops:
    no module of either imports or names tfcore.kernels, and no line keeps the mark of
    the transitional dispatch."""
    modules = _modules(folder)
    assert modules, folder
    reaching = [line for path in modules for line in _lines_reaching_kernels(path)]
    assert reaching == [], f"tfcore.{folder} reaches tfcore.kernels:\n" + "\n".join(reaching)
    marked = [f"{path.name}:{n}" for path in modules
              for n, line in enumerate(path.read_text().splitlines(), 1) if MARK in line]
    assert marked == [], marked


def test_the_kernel_check_sees_every_way_of_reaching_the_kernels(tmp_path):
    """The check above fails on each form a module could use."""
    for line in ("from .. import kernels", "from ..kernels import add", "import tfcore.kernels",
                 "from tfcore import kernels", "def f():\n    from .. import kernels",
                 "x = tfcore.kernels.add"):
        path = tmp_path / "mod.py"
        path.write_text(line + "\n")
        assert _lines_reaching_kernels(path), line
    path.write_text("from .. import ops\ny = ops.add\n")
    assert _lines_reaching_kernels(path) == []


def test_kernels_import_nothing_of_functional_at_module_level():
    found = []
    for path in _modules("kernels"):
        for module, names, line in _module_level_imports(ast.parse(path.read_text())):
            if module.startswith(("..functional", "tfcore.functional")) or (
                    module in ("..", "tfcore") and "functional" in names):
                found.append(f"{path.name}:{line}: {module} {names}")
    assert not found, found


def test_ops_never_imports_kernels_at_module_level():
    tree = ast.parse((PACKAGE / "ops.py").read_text())
    assert not [m for m, names, _ in _module_level_imports(tree) if _imports_kernels(m, names)]
    for path in _modules("functional"):      # and the reference imports no ops
        for module, names, _ in _module_level_imports(ast.parse(path.read_text())):
            assert not (module.startswith("..ops") or "ops" in names and module == ".."), path


@pytest.mark.parametrize("first", ["tfcore", "tfcore.ops", "tfcore.kernels",
                                   "tfcore.functional.linear", "tfcore.nn"])
def test_any_import_order_registers_every_kernel(first):
    code = (f"import {first}\nfrom tfcore import ops\n"
            "missing = [op for op in ops.OPS if not ops.registered(op)]\n"
            "assert not missing, missing\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# -- the registry -------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def numpy_backend(kernels_on_numpy):
    """The registry's kernels run on NumPy (conftest's kernels_on_numpy)."""


def test_register_refuses_what_it_cannot_use():
    with pytest.raises(ValueError, match="op must be one of"):
        ops.register("conv2d", lambda x: x, applies=lambda x: True)
    with pytest.raises(TypeError, match="kernel must be callable"):
        ops.register("add", None, applies=lambda a, b: True)
    with pytest.raises(TypeError, match="applies must be callable"):
        ops.register("add", lambda a, b: a + b, applies=True)
    with pytest.raises(ValueError, match="op must be one of"):
        ops.registered("conv2d")


def test_one_switch_turns_every_kernel_off():
    x = np.ones((4, 6))
    assert ops.kernel_for("add", x, x) is not None or not kernels.available()
    with kernels.disabled():
        assert not ops.kernels_enabled() and not kernels.enabled()
        assert ops.kernel_for("add", x, x) is None and not kernels.applies(x)
    with ops.reference_only():
        assert not kernels.enabled() and ops.kernel_for("add", x, x) is None
    previous = ops.set_kernels_enabled(False)
    assert not kernels.enabled()
    ops.set_kernels_enabled(previous)
    assert kernels.enabled() == kernels.available()


def _r(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def _cases(rng, dtype):
    """op -> (the call through ops or optim, its arguments): one call the kernel takes."""
    x, W, b = _r(rng, (3, 5, 8), dtype), _r(rng, (8, 6), dtype), _r(rng, (6,), dtype)
    dy = _r(rng, (3, 5, 6), dtype)
    lin = F.linear_forward(x, W, b)[1]
    g, beta = _r(rng, (8,), dtype) + 1.0, _r(rng, (8,), dtype)
    z = _r(rng, (3, 5, 8), dtype, 2.0)
    logits, labels = _r(rng, (3, 5, 11), dtype), rng.integers(0, 11, (3, 5))
    labels[0, 0] = -100
    q, k, v = (_r(rng, (2, 3, 7, 4), dtype) for _ in range(3))
    dout = _r(rng, (2, 3, 7, 4), dtype)
    qkv = _r(rng, (2, 7, 3 * 12), dtype)
    views = F.qkv_split(qkv, 3)
    ids = rng.integers(0, 9, (3, 5))
    emb = F.embedding_forward(ids, _r(rng, (9, 8), dtype))[1]
    n = 257
    state = [_r(rng, n, dtype), _r(rng, n, dtype), _r(rng, n, dtype, 0.1),
             np.abs(_r(rng, n, dtype, 0.01))]
    with kernels.disabled():            # reference caches: a kernel takes either path's
        caches = dict(ln=F.layernorm_forward(x, g, beta)[1], rms=F.rmsnorm_forward(x, g)[1],
                      ce=F.cross_entropy_forward(logits, labels)[1],
                      att=F.attention_forward(q, k, v, causal=True)[1],
                      tiled=F.tiled_attention_forward(q, k, v, causal=True, block_size=3)[1])
    # the kernel's dq, dk, dv: views of one [B, S, 3, H, D_h] buffer, merged without a copy
    caches["grads"] = ops.attention_backward(dout[:, :, :, :4], ops.attention_forward(*views)[1])

    def adamw(p, g_, m, v_, *args):
        p, m, v_ = p.copy(), m.copy(), v_.copy()
        optim.adamw_update(p, g_, m, v_, *args)
        return p, m, v_

    def into(dy_, cache, gW, gb):
        gW, gb = gW.copy(), gb.copy()
        return ops.linear_backward_into(dy_, cache, gW, gb), gW, gb

    return {
        "linear_forward": (ops.linear_forward, (x, W, b)),
        "linear_backward": (ops.linear_backward, (dy, lin)),
        "linear_backward_into": (into, (dy, lin, _r(rng, (8, 6), dtype), _r(rng, (6,), dtype))),
        "gelu_forward": (ops.gelu_forward, (z, "tanh")),
        "gelu_backward": (ops.gelu_backward, (dy, (_r(rng, (3, 5, 6), dtype), "none"))),
        "softmax_forward": (ops.softmax_forward, (z,)),
        "softmax_backward": (ops.softmax_backward, (z, F.softmax_forward(z)[0])),
        "layernorm_forward": (ops.layernorm_forward, (x, g, beta)),
        "layernorm_backward": (ops.layernorm_backward, (_r(rng, (3, 5, 8), dtype),
                                                        caches["ln"])),
        "rmsnorm_forward": (ops.rmsnorm_forward, (x, g)),
        "rmsnorm_backward": (ops.rmsnorm_backward, (_r(rng, (3, 5, 8), dtype), caches["rms"])),
        "cross_entropy_forward": (ops.cross_entropy_forward, (logits, labels)),
        "cross_entropy_backward": (ops.cross_entropy_backward, (0.7, caches["ce"])),
        "embedding_backward": (ops.embedding_backward, (x, emb)),
        "attention_forward": (lambda *a: ops.attention_forward(*a, causal=True), (q, k, v)),
        "attention_backward": (ops.attention_backward, (dout, caches["att"])),
        "tiled_attention_forward": (lambda *a: ops.tiled_attention_forward(
            *a, causal=True, block_size=3), (q, k, v)),
        "tiled_attention_backward": (ops.tiled_attention_backward, (dout, caches["tiled"])),
        "qkv_merge_grads": (ops.qkv_merge_grads, caches["grads"]),
        "residual_forward": (ops.residual_forward, (x, _r(rng, (3, 5, 8), dtype))),
        "residual_backward": (ops.residual_backward, (x[:, ::2],)),     # a strided view too
        "dropout_forward": (lambda *a: ops.dropout_forward(*a, training=False), (x, 0.3)),
        "dropout_backward": (ops.dropout_backward, (_r(rng, (3, 5, 8), dtype),
                                                    F.dropout_forward(x, 0.0)[1])),
        "add": (ops.add, (x, _r(rng, (3, 5, 8), dtype))),
        "adamw_update": (adamw, (*state, 3, 1e-2, 0.9, 0.95, 1e-8, 0.1, None)),
    }


def _arrays(result):
    """The arrays of a result (nested tuples, named tuples, dicts), as float64 NumPy."""
    if isinstance(result, dict):
        return [a for key in sorted(result) for a in _arrays(result[key])]
    if isinstance(result, (tuple, list)):
        return [a for item in result for a in _arrays(item)]
    if isinstance(result, np.ndarray) and result.dtype.kind == "f" or isinstance(result,
                                                                                 np.floating):
        return [np.asarray(result, dtype=np.float64)]
    return []


def _spy(monkeypatch, op):
    """Wrap op's registered kernels so that each call is counted."""
    calls = []
    wrapped = []
    for kernel in ops.registered(op):
        def run(*args, _run=kernel.run, **kwargs):
            calls.append(op)
            return _run(*args, **kwargs)
        wrapped.append(ops.Kernel(run, kernel.applies))
    monkeypatch.setitem(ops._KERNELS, op, tuple(wrapped))
    return calls


@pytest.mark.usefixtures("numba_installed")
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("op", ops.OPS)
def test_the_seat_calls_the_kernel_where_it_applies_and_the_reference_elsewhere(
        monkeypatch, op, dtype):
    rng = np.random.default_rng(7)
    call, args = _cases(rng, dtype)[op]
    calls = _spy(monkeypatch, op)
    fast = call(*args)
    assert calls == [op], f"{op}: the kernel was not called where its predicate holds"
    with kernels.disabled():
        reference = call(*args)
    assert calls == [op], f"{op}: a kernel ran with the kernels switched off"
    fast, reference = _arrays(fast), _arrays(reference)
    assert len(fast) == len(reference) > 0
    tol = 1e-12 if dtype == "float64" else 2e-6
    for a, b in zip(fast, reference):
        assert a.shape == b.shape
        scale = max(np.linalg.norm(b), 1e-300)
        assert np.linalg.norm(a - b) / scale <= tol, (op, np.linalg.norm(a - b) / scale)


@pytest.fixture
def numba_installed():
    assert kernels.available(), "Numba is not installed: run `make setup` (requirements.txt)"


def test_every_op_has_a_kernel_and_a_call():
    assert all(ops.registered(op) for op in ops.OPS)
    assert set(_cases(np.random.default_rng(0), "float64")) == set(ops.OPS)
    for op in ops.OPS:
        if op != "adamw_update":                  # optim.adamw_update asks kernel_for itself
            assert callable(getattr(ops, op)), op
    for op in ops.OPS:                           # the same signature as the reference op
        reference = getattr(F, op, None)
        if reference is not None:
            mine = [(p.name, p.default, p.kind)
                    for p in inspect.signature(getattr(ops, op)).parameters.values()
                    if p.name != "trusted"]
            theirs = [(p.name, p.default, p.kind)
                      for p in inspect.signature(reference).parameters.values()]
            assert mine == theirs, op


def test_a_predicate_that_does_not_hold_runs_the_reference(monkeypatch):
    """Strided or mixed-dtype arrays, another backend: no kernel, the reference's bits."""
    rng = np.random.default_rng(3)
    calls = _spy(monkeypatch, "gelu_forward")
    x = _r(rng, (4, 10), "float64")[:, ::2]
    y, cache = ops.gelu_forward(x, "tanh")
    assert calls == [] and np.array_equal(y, F.gelu_forward(x, "tanh")[0])
    calls = _spy(monkeypatch, "linear_forward")
    W = _r(rng, (5, 3), "float32")
    y, cache = ops.linear_forward(x, W.astype(np.float64))
    assert calls == ["linear_forward"]
    with pytest.raises(TypeError):
        ops.linear_forward(x, W)                  # mixed dtypes: the reference refuses them
    assert calls == ["linear_forward"]


def test_another_backend_runs_the_reference(monkeypatch):
    calls = _spy(monkeypatch, "gelu_forward")
    backend.set_backend("strict")
    x = backend.asarray(np.linspace(-2, 2, 12).reshape(3, 4))
    y, cache = ops.gelu_forward(x, "tanh")
    assert calls == [] and type(cache).__name__ == "GeluCache" and cache.approximate == "tanh"
    assert np.array_equal(backend.to_numpy(y), backend.to_numpy(F.gelu_forward(x, "tanh")[0]))


def test_bad_input_raises_the_reference_error_on_the_kernel_path():
    rng = np.random.default_rng(4)
    x = _r(rng, (3, 8), "float64")
    for call in (lambda: ops.linear_forward(x, _r(rng, (7, 2), "float64")),
                 lambda: ops.layernorm_forward(x, np.ones(8), np.zeros(8), eps=0.0),
                 lambda: ops.gelu_forward(x, "erf"),
                 lambda: ops.softmax_forward(np.full((2, 3), -np.inf)),
                 lambda: ops.cross_entropy_forward(x, np.array([0, 9, 1])),
                 lambda: ops.tiled_attention_forward(*(_r(rng, (1, 1, 5, 4), "float64"),) * 3,
                                                     block_size=0)):
        with pytest.raises(ValueError) as fast:
            call()
        with kernels.disabled(), pytest.raises(ValueError) as reference:
            call()
        assert str(fast.value) == str(reference.value)
    _, cache = ops.linear_forward(x, _r(rng, (8, 2), "float64"))
    with pytest.raises(ValueError, match="dy"):
        ops.linear_backward(_r(rng, (3, 3), "float64"), cache)


def test_trusted_calls_skip_the_checks_only_where_a_kernel_runs(monkeypatch):
    seen = []
    from tfcore.functional import linear

    original = linear._check_linear_forward
    monkeypatch.setattr(linear, "_check_linear_forward",
                        lambda *a: seen.append(1) or original(*a))
    x, W = np.ones((4, 3)), np.ones((3, 2))
    ops.linear_forward(x, W, trusted=True)
    assert seen == [] or not kernels.available()
    ops.linear_forward(x, W)
    monkeypatch.setattr(ops, "CHECK_TRUSTED", True)
    ops.linear_forward(x, W, trusted=True)
    assert len(seen) == 2 or not kernels.available()


def test_dropout_and_the_residual_backward_kernels_hand_back_their_input(monkeypatch):
    """dropout's kernel takes only the calls that drop nothing (p == 0, or evaluation) and
    returns x itself with a cache without a mask; a call that draws a mask runs the
    reference, and so does the backward of its cache; the residual sum's backward hands dy
    itself to both branches. Bad settings raise the reference's error on the kernel path."""
    calls = _spy(monkeypatch, "dropout_forward")
    back = _spy(monkeypatch, "dropout_backward")
    x = np.ones((4, 6))
    y, cache = ops.dropout_forward(x, 0.5, training=False)
    assert y is x and cache.keep is None and calls == ["dropout_forward"]
    y, cache = ops.dropout_forward(x, 0.5, backend.default_rng(0))
    assert calls == ["dropout_forward"] and cache.keep is not None and 0 < y.sum() < 2 * x.size
    assert np.array_equal(ops.dropout_backward(x, cache), y) and back == []
    assert ops.dropout_backward(x, ops.dropout_forward(x, 0.0)[1]) is x
    assert back == ["dropout_backward"]
    for bad in (lambda: ops.dropout_forward(x, 1.5, training=False),
                lambda: ops.dropout_backward(x[:2], ops.dropout_forward(x, 0.0)[1])):
        with pytest.raises(ValueError) as fast:
            bad()
        with kernels.disabled(), pytest.raises(ValueError) as reference:
            bad()
        assert str(fast.value) == str(reference.value)
    dx, dfx = ops.residual_backward(x)
    assert dx is x and dfx is x
