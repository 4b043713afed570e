"""Optimizers over one flat parameter buffer: SGD with momentum, Adam, AdamW, clipping, schedule.

A model keeps every parameter in one 1-D array ``params.data`` [N] and every gradient in
another of the same layout, ``params.grad`` [N] (``tfcore.nn.Parameters``). An optimizer step
is then a handful of vectorized, in-place operations over the whole model, whatever its
architecture: no loop over tensors.

The arithmetic lives in two functional cores, ``sgd_update`` and ``adamw_update``, which
update any 1-D slice in place. The classes keep the state and the hyperparameters, and step
over a *shard view* (``ShardView``): which part [Z] of the flat buffers this optimizer
updates, how its summed gradient reaches it, and what happens after the update. The base
view is one device's (the whole buffers, Z = P, the gradient as it is); the data-parallel
strategies (replicated, ZeRO-1, ZeRO-2/3) are views written in ``tfcore.parallel.optimizer``
with their collectives, so one AdamW serves every layout. With ``clip`` the optimizer clips
the view's gradient by the global norm (``clip_grad_norm`` over the view's pieces) first.

Adam is seed 002's form, with bias correction (derived in the Training chapter)::

    m_t = beta1 m_{t-1} + (1 - beta1) g_t          v_t = beta2 v_{t-1} + (1 - beta2) g_t^2
    m^_t = m_t / (1 - beta1^t)                       v^_t = v_t / (1 - beta2^t)
    theta_t = theta_{t-1} - lr m^_t / (sqrt(v^_t) + eps)

AdamW (Loshchilov and Hutter) adds decoupled weight decay, ``theta <- theta - lr wd theta``,
applied only where the decay mask is 1 (weight matrices; not biases, norm gains, embeddings).

No silent poison: every hyperparameter is checked whenever it is set (also by a schedule,
``opt.lr = ...``), and ``step()`` refuses a gradient holding nan or inf (FloatingPointError)
before it touches the parameters or the moments. With ``skip_nonfinite=True`` such a step is
skipped instead and counted in ``opt.skipped`` (what mixed-precision loss scaling does with
an overflowed step); ``opt.t`` counts only the updates really made.
"""
from __future__ import annotations

import math

import numpy as np

from . import checks, ops
from .backend import is_cupy, is_numpy, namespace, to_numpy

CLIP_GUARD = 1e-6          # added to the norm before dividing (as PyTorch)


def _ufunc_library(x):
    """NumPy or CuPy when x lives there (ufuncs with out=, no temporaries), else None."""
    if is_numpy(x):
        import numpy

        return numpy
    if is_cupy(x):
        import cupy

        return cupy
    return None


def _check_state(p, g, **state):
    checks.float_inputs(p=p, g=g, **state)
    checks.ndim("p", p, 1)
    for name, x in {"g": g, **state}.items():
        if x is not None:
            checks.shape(name, x, (p.shape[0],))


def check_hyperparameter(name: str, value) -> float:
    """The value of an optimizer's hyperparameter `name` as a float, or a ValueError naming it.

    lr, weight_decay, momentum: finite and >= 0 (a schedule may reach lr = 0);
    eps: finite and > 0; beta1, beta2: in [0, 1).
    """
    value = checks.real(name, value)
    if name in ("beta1", "beta2"):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must lie in [0, 1), got {value}")
    elif name == "eps":
        checks.positive(name, value)
    elif not (value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


def sgd_update(p, g, buf, lr: float, momentum: float = 0.0):
    """In place: buf <- momentum buf + g, p <- p - lr buf (plain SGD when momentum is 0).

    p, g [N] float; buf [N] (the momentum buffer, zeros before the first step; may be None
    when momentum is 0). This is PyTorch's form: the first step moves by lr g.
    """
    _check_state(p, g, buf=buf)
    check_hyperparameter("lr", lr)
    check_hyperparameter("momentum", momentum)
    if momentum == 0.0:
        p -= lr * g
        return
    if buf is None:
        raise ValueError("sgd_update with momentum needs a buffer buf of p's shape")
    buf *= momentum
    buf += g
    p -= lr * buf


def adamw_update(p, g, m, v, step: int, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.0, decay_mask=None):
    """One Adam step with decoupled weight decay, in place on p, m and v.

    p, g, m, v [N] float (m and v zeros before the first step); step t >= 1 counts this
    update; decay_mask [N] of 0/1 in p's dtype, or None to decay every entry. In order:

        p <- p (1 - lr wd mask)                         (decoupled decay; skipped if wd = 0)
        m <- beta1 m + (1 - beta1) g
        v <- beta2 v + (1 - beta2) g^2
        p <- p - (lr / (1 - beta1^t)) m / (sqrt(v / (1 - beta2^t)) + eps)

    The last line is lr m^ / (sqrt(v^) + eps) with the bias corrections folded into
    scalars, so no array m^ or v^ is ever made. With weight_decay 0 this is seed 002's Adam.
    One scratch array of size N is the only temporary.
    """
    _check_state(p, g, m=m, v=v, decay_mask=decay_mask)
    if int(step) != step or step < 1:
        raise ValueError(f"step counts the updates made, starting at 1; got {step}")
    for name, value in (("lr", lr), ("beta1", beta1), ("beta2", beta2), ("eps", eps),
                        ("weight_decay", weight_decay)):
        check_hyperparameter(name, value)
    bias1 = 1.0 - beta1**step
    bias2 = 1.0 - beta2**step
    run = ops.kernel_for("adamw_update", p, g, m, v, step, lr, beta1, beta2, eps,
                         weight_decay, decay_mask)
    if run is not None:                 # the same arithmetic in one pass (tfcore.ops' table)
        run(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bias1, bias2, decay_mask)
        return
    lib = _ufunc_library(p)
    if lib is not None:
        # NumPy/CuPy: every operation writes into m, v, p or the one scratch array.
        work = lib.empty_like(p)
        if weight_decay:
            if decay_mask is None:
                p *= 1.0 - lr * weight_decay
            else:
                lib.multiply(decay_mask, -lr * weight_decay, out=work)
                work += 1.0
                p *= work
        m *= beta1
        lib.multiply(g, 1.0 - beta1, out=work)
        m += work
        v *= beta2
        lib.multiply(g, g, out=work)
        work *= 1.0 - beta2
        v += work
        lib.divide(v, bias2, out=work)
        lib.sqrt(work, out=work)
        work += eps
        lib.divide(m, work, out=work)
        work *= lr / bias1
        p -= work
        return
    # Any other array-API library: the same arithmetic in the same order, with temporaries.
    xp = namespace(p)
    if weight_decay:
        if decay_mask is None:
            p *= 1.0 - lr * weight_decay
        else:
            p *= decay_mask * (-lr * weight_decay) + 1.0
    m *= beta1
    m += g * (1.0 - beta1)
    v *= beta2
    v += (g * g) * (1.0 - beta2)
    p -= (m / (xp.sqrt(v / bias2) + eps)) * (lr / bias1)


def grad_norm(grad_flat) -> float:
    """The global L2 norm sqrt(sum g^2) of a flat gradient [N], as a Python float."""
    xp = namespace(grad_flat)
    return float(xp.linalg.vector_norm(grad_flat))


def _piece(piece):
    """(grad, where) of a gradient piece: an array, or an object with .grad and .where."""
    if hasattr(piece, "grad"):
        return piece.grad, getattr(piece, "where", None)
    return piece, None


def sum_of_squares(piece):
    """sum g^2 over a gradient piece, a 0-d array in the gradient's dtype.

    piece: an array (any shape), or an object with .grad (an array) and .where (None, or
    a boolean mask of grad's shape: the elements that belong to the piece)."""
    g, where = _piece(piece)
    xp = namespace(g)
    squares = g * g
    if where is not None:
        checks.shape("where", where, tuple(g.shape))
        squares = xp.where(where, squares, xp.zeros_like(squares))
    return xp.sum(squares)


def clip_grad_norm(pieces, max_norm: float, sum_squares=None) -> float:
    """Scale the gradient in place so that its global L2 norm is at most max_norm.

    pieces: the gradient this rank holds, as one array (a flat gradient [N]) or a list of
    pieces (arrays, or objects with .grad and an optional boolean mask .where, as
    tfcore.parallel.grads.GradPiece); several pieces may share one buffer, which is
    scaled once. sum_squares: optional callable(pieces) -> the global sum of squares (a
    float) when the gradient is spread over ranks (it sums each piece once over the
    groups that share it); by default the sum of the pieces' sum_of_squares, here.

    Returns the norm before clipping. As in PyTorch, the factor is
    max_norm / (norm + 1e-6) when it is below 1 (the 1e-6 guards a zero gradient), so a
    clipped gradient keeps its direction and has norm just under max_norm. A norm that is
    nan or inf raises FloatingPointError before anything is scaled.
    """
    checks.positive("max_norm", max_norm)
    pieces = [pieces] if not isinstance(pieces, (list, tuple)) else list(pieces)
    if not pieces:
        raise ValueError("pieces must hold at least one gradient piece")
    for i, piece in enumerate(pieces):
        checks.float_inputs(**{f"pieces[{i}]": _piece(piece)[0]})
    if sum_squares is None:
        total = sum_of_squares(pieces[0])
        for piece in pieces[1:]:
            total = total + sum_of_squares(piece)
        norm = float(namespace(_piece(pieces[0])[0]).sqrt(total))   # in the gradient's dtype
    else:
        norm = math.sqrt(float(sum_squares(pieces)))
    if not math.isfinite(norm):
        raise FloatingPointError(f"the gradient norm is {norm}: a gradient overflowed or is nan")
    factor = max_norm / (norm + CLIP_GUARD)
    if factor < 1.0:
        seen = set()
        for piece in pieces:
            g = _piece(piece)[0]
            if id(g) not in seen:
                seen.add(id(g))
                g *= factor
    return norm


def warmup_cosine(step: int, max_lr: float, warmup_steps: int, total_steps: int,
                  min_lr: float = 0.0) -> float:
    """The learning rate of update number `step` (0-based): linear warmup, then cosine decay.

        step < W:        max_lr (step + 1) / W                       (W = warmup_steps)
        W <= step <= T:  min_lr + (max_lr - min_lr) (1 + cos(pi (step - W) / (T - W))) / 2
        step > T:        min_lr                                      (T = total_steps)

    So the first update already moves (lr = max_lr / W), the rate reaches max_lr at step W
    and min_lr at step T.
    """
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps} "
                         f"and {total_steps}")
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must not exceed total_steps "
                         f"({total_steps})")
    if not 0 <= min_lr <= max_lr:
        raise ValueError(f"need 0 <= min_lr <= max_lr, got min_lr={min_lr}, max_lr={max_lr}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step > total_steps or total_steps == warmup_steps:
        return min_lr
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


class ShardView:
    """The part of the flat buffers an optimizer updates, and how its gradient reaches it.

    This base view is one device's: the whole buffers (Z = P), the gradient as it is, nothing
    after the update. A data-parallel strategy (tfcore.parallel.optimizer: replicated,
    ZeRO-1, ZeRO-2/3) overrides the hooks with its collectives; the optimizer's arithmetic
    is the same vectorized update on the [Z] arrays the view hands it.

        size(params)            Z, the elements this rank updates (its m and v are [Z])
        select(params, full)    the view's part [Z] of a per-element array [P] (the decay mask)
        gradient(params)        the summed gradient of the view [Z]
        parameters(params)      the values [Z] to update in place
        publish(params, values) after the update: make params whole again (an all-gather)
        pieces(grad)            the gradient as pieces for clip_grad_norm
        sum_squares             None, or the global sum of squares over the ranks' pieces
    same_on_every_rank: every rank holding the view sees the same gradient, so all take the
    same decision on a non-finite one (a skip is then safe)."""

    same_on_every_rank = True
    sum_squares = None

    def size(self, params) -> int:
        return int(params.data.shape[0])

    def select(self, params, full):
        return full

    def gradient(self, params):
        return params.grad

    def parameters(self, params):
        return params.data

    def publish(self, params, values) -> None:
        return None

    def pieces(self, grad) -> list:
        return [grad]


class _Optimizer:
    """Shared by the optimizers: holds `params` (data and grad), the shard view, the step
    count and the clip; step() is the same for every optimizer and every view.

    t counts the updates made; skipped counts the steps refused for a non-finite gradient
    when skip_nonfinite is True. Hyperparameters are checked on every assignment.
    clip: None, or the max_norm of clipping the view's gradient by the global norm before
    each update (the norm before clipping is kept as last_norm).
    """

    kind = "optimizer"
    _buffers: tuple[str, ...] = ()
    _hyper: tuple[str, ...] = ()

    def __init__(self, params, skip_nonfinite: bool = False, shard=None, clip=None):
        for attr in ("data", "grad"):
            if not hasattr(params, attr):
                raise TypeError(f"an optimizer takes a tfcore.nn.Parameters (with .data and "
                                f".grad), got {type(params).__name__}")
        checks.ndim("params.data", params.data, 1)
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(f"skip_nonfinite must be True or False, got {skip_nonfinite!r}")
        shard = ShardView() if shard is None else shard
        if not isinstance(shard, ShardView):
            raise TypeError(f"shard must be a tfcore.optim.ShardView, got "
                            f"{type(shard).__name__}")
        if skip_nonfinite and not shard.same_on_every_rank:
            raise ValueError(f"skip_nonfinite needs every rank to see the same gradient; "
                             f"under {type(shard).__name__} each rank holds another shard, "
                             "so the ranks could disagree on a skip")
        self.params = params
        self.shard = shard
        self.size = shard.size(params)                 # Z
        self.clip = None if clip is None else checks.positive("clip", clip)
        self.last_norm = None
        self.skip_nonfinite = skip_nonfinite
        self.t = 0  # updates made so far
        self.skipped = 0  # steps skipped for a non-finite gradient

    def __setattr__(self, name, value):
        # Every hyperparameter is checked when it is set: a schedule cannot slip in a nan.
        if name in ("lr", "momentum", "eps", "weight_decay"):
            value = check_hyperparameter(name, value)
        elif name == "betas":
            if not isinstance(value, (tuple, list)) or len(value) != 2:
                raise ValueError(f"betas must be a pair (beta1, beta2), got {value!r}")
            value = (check_hyperparameter("beta1", value[0]),
                     check_hyperparameter("beta2", value[1]))
        object.__setattr__(self, name, value)

    def step(self) -> None:
        """One update: the view's summed gradient [Z] (a collective under data
        parallelism), refused if non-finite (FloatingPointError, or a counted skip with
        skip_nonfinite), clipped with clip, the update in place on the view's values [Z]
        and the optimizer state, then the view publishes the values."""
        grad = self.shard.gradient(self.params)                         # [Z]
        if not self._gradient_is_finite(grad):
            return
        if self.clip is not None:
            self.last_norm = clip_grad_norm(self.shard.pieces(grad), self.clip,
                                            self.shard.sum_squares)
        self.t += 1
        values = self.shard.parameters(self.params)                     # [Z]
        self._update(values, grad)
        self.shard.publish(self.params, values)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its buffers, [Z] each)."""
        return sum(math.prod(getattr(self, name).shape)
                   * np.dtype(checks.dtype_name(getattr(self, name))).itemsize
                   for name in self._buffers)

    def _zeros(self):
        xp = namespace(self.params.data)
        return xp.zeros((self.size,), dtype=self.params.data.dtype)          # [Z]

    def _gradient_is_finite(self, grad) -> bool:
        """True when grad holds no nan or inf; otherwise raise, or count a skip."""
        if type(grad) is np.ndarray and grad.size:
            # no [P] boolean temporary: the max is nan when any entry is (NumPy's reductions
            # propagate nan), and an inf is the max or the min
            if math.isfinite(grad.max()) and math.isfinite(grad.min()):
                return True
        else:
            xp = namespace(grad)
            if bool(xp.all(xp.isfinite(grad))):
                return True
        if self.skip_nonfinite:
            self.skipped += 1
            return False
        raise FloatingPointError(
            f"the gradient holds nan or inf (update {self.t + 1}): refusing to update the "
            "parameters; find the overflow, lower the learning rate, or create the optimizer "
            "with skip_nonfinite=True to skip such steps and count them")

    def state_dict(self) -> dict:
        """{'kind', 't', 'skipped', hyperparameters..., buffers...}: scalars and flat arrays
        [N] only (the arrays are the optimizer's own: copy them before changing them)."""
        state = {"kind": self.kind, "t": self.t, "skipped": self.skipped}
        state.update({name: getattr(self, name) for name in self._hyper})
        state.update({name: getattr(self, name) for name in self._buffers})
        return state

    def check_state_dict(self, state: dict) -> dict:
        """Check a state_dict against this optimizer without changing anything.

        Refuses another kind, other hyperparameters (lr excepted: a schedule sets it), a
        step count that is not an integer >= 0, buffers of another shape, holding nan or
        inf, a negative second moment, or non-zero moments before the first update.
        Returns the buffers as host arrays {name: [N]}.
        """
        if not isinstance(state, dict):
            raise ValueError(f"optimizer state must be a dict, got {type(state).__name__}")
        if state.get("kind") != self.kind:
            raise ValueError(f"optimizer state is for {state.get('kind')!r}, not {self.kind!r}")
        missing = [k for k in ("t", *self._hyper, *self._buffers) if k not in state]
        if missing:
            raise ValueError(f"optimizer state lacks {', '.join(missing)}")
        for name in ("t", "skipped"):
            value = state.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"optimizer state {name} must be an integer >= 0, got "
                                 f"{value!r}")
        for name in self._hyper:
            ours, theirs = getattr(self, name), state[name]
            try:
                if name == "betas":
                    if not isinstance(theirs, (tuple, list)) or len(theirs) != 2:
                        raise ValueError(f"betas must be a pair, got {theirs!r}")
                    for b_name, b in zip(("beta1", "beta2"), theirs):
                        check_hyperparameter(b_name, b)
                else:
                    check_hyperparameter(name, theirs)
            except (TypeError, ValueError) as err:
                raise ValueError(f"optimizer state: {err}") from None
            if name != "lr" and _as_tuple(ours) != _as_tuple(theirs):
                raise ValueError(f"optimizer state has {name}={theirs!r}, this optimizer "
                                 f"{name}={ours!r}")
        n = self.size
        arrays = {}
        for name in self._buffers:
            host = np.asarray(to_numpy(state[name]))
            if tuple(host.shape) != (n,):
                raise ValueError(f"optimizer state {name} has shape {tuple(host.shape)}, the "
                                 f"parameters ({n},)")
            if host.dtype.kind != "f":
                raise ValueError(f"optimizer state {name} must hold floats, got {host.dtype}")
            if not np.all(np.isfinite(host)):
                raise ValueError(f"optimizer state {name} holds nan or inf")
            if name == "v" and np.any(host < 0):
                raise ValueError("optimizer state v (the second moment) holds negative values")
            if int(state["t"]) == 0 and np.any(host != 0):
                raise ValueError(f"optimizer state has t = 0 (no update made) but a non-zero "
                                 f"{name}")
            arrays[name] = host
        return arrays

    def load_state_dict(self, state: dict) -> None:
        """Restore a state_dict: checks everything first, then copies (nothing changes on error)."""
        arrays = self.check_state_dict(state)
        xp = namespace(self.params.data)
        self.t = int(state["t"])
        self.skipped = int(state.get("skipped", 0))
        self.lr = float(state["lr"])
        for name, host in arrays.items():
            getattr(self, name)[...] = xp.asarray(host, dtype=self.params.data.dtype)


def _as_tuple(x):
    return tuple(float(v) for v in x) if isinstance(x, (tuple, list)) else x


class SGD(_Optimizer):
    """SGD with (heavy-ball) momentum over a Parameters: buf <- mu buf + g, p <- p - lr buf."""

    kind = "SGD"
    _buffers = ("momentum_buffer",)
    _hyper = ("lr", "momentum")

    def __init__(self, params, lr: float, momentum: float = 0.0, skip_nonfinite: bool = False,
                 shard: ShardView | None = None, clip: float | None = None):
        super().__init__(params, skip_nonfinite, shard, clip)
        checks.positive("lr", lr)
        self.lr, self.momentum = lr, momentum
        self.momentum_buffer = self._zeros()                              # [Z]

    def _update(self, values, grad) -> None:
        sgd_update(values, grad, self.momentum_buffer, self.lr, self.momentum)


class AdamW(_Optimizer):
    """Adam with bias correction and decoupled weight decay over a Parameters.

    weight_decay applies where `decay_mask` [P] is 1; by default `params.decay_mask()`
    (weight matrices only). `lr` may be changed between steps (a schedule sets it).
    shard: the ShardView this rank updates (default: the whole buffers, one device);
    m, v [Z]: the first and second moment estimates of the view, zeros before the first
    step. clip: max_norm of clipping the view's gradient by its global norm.
    """

    kind = "AdamW"
    _buffers = ("m", "v")
    _hyper = ("lr", "betas", "eps", "weight_decay")

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, decay_mask=None,
                 skip_nonfinite: bool = False, shard: ShardView | None = None,
                 clip: float | None = None):
        super().__init__(params, skip_nonfinite, shard, clip)
        checks.positive("lr", lr)
        self.lr, self.betas = lr, betas
        self.eps, self.weight_decay = eps, weight_decay
        if self.weight_decay and decay_mask is None:
            decay_mask = params.decay_mask()
        if decay_mask is not None:
            decay_mask = self.shard.select(params, decay_mask)             # [Z]
            checks.shape("decay_mask", decay_mask, (self.size,))
            xp = namespace(params.data)
            decay_mask = xp.astype(decay_mask, params.data.dtype)
        self.decay_mask = decay_mask
        self.m = self._zeros()                                             # [Z]
        self.v = self._zeros()

    def _update(self, values, grad) -> None:
        adamw_update(values, grad, self.m, self.v, self.t, self.lr, self.betas[0],
                     self.betas[1], self.eps, self.weight_decay, self.decay_mask)


class Adam(AdamW):
    """Seed 002's Adam: bias-corrected, no weight decay (AdamW with weight_decay 0)."""

    kind = "Adam"
    _hyper = ("lr", "betas", "eps")

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, skip_nonfinite: bool = False,
                 shard: ShardView | None = None, clip: float | None = None):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=0.0,
                         skip_nonfinite=skip_nonfinite, shard=shard, clip=clip)


OPTIMIZERS = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}
