"""Every bad input gets a clear, catchable error (never a crash), and NaN/Inf propagate as in
PyTorch.

The bad-input matrix is one test per row: an entry point (public function, module or op), the
bad input, the exception type, and a pattern the message must match -- the argument's name and
what was expected. After each error the process must still compute correctly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import fusedmlp
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode

ops = torch.ops.fusedmlp
VALID_NAMES = "valid names are none, relu, gelu, gelu_tanh, silu"
HUGE_ROWS = 2**62  # rows of an expanded view: x itself is one element


ErrorTypes = type[Exception] | tuple[type[Exception], ...]
Row = tuple[str, Callable[[], tuple], ErrorTypes, str]


@dataclass(frozen=True)
class Case:
    """One row of the matrix: call() must raise `error` with a message matching `match`."""

    id: str
    call: Callable[[], object]
    error: ErrorTypes
    match: str


def _x(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> Tensor:
    return torch.randn(*shape, dtype=dtype, device=device)


def _huge_x(features: int = 1) -> Tensor:
    """A (2^62, features) view of a single element: its products with any width > 1 overflow."""
    return torch.randn(1, 1).expand(HUGE_ROWS, features)


# ---- linear: functional, op and training op share every row ----

LinearCall = Callable[[Tensor, Tensor, "Tensor | None", str], object]
LINEAR_ENTRIES: dict[str, LinearCall] = {
    "fusedmlp.linear": lambda x, w, b, act: fusedmlp.linear(x, w, b, act),
    "ops.linear": lambda x, w, b, act: ops.linear(x, w, b, act),
    "ops.linear_train": lambda x, w, b, act: ops.linear_train(x, w, b, act),
}
W = (5, 4)


def _linear_rows() -> list[Row]:
    """(id, () -> (x, weight, bias, activation), error, message pattern)."""
    dtype_msg = r"x has dtype {}, but on cpu only Float, Double, BFloat16 are supported"
    rows = [
        (
            "0-d x",
            lambda: (torch.tensor(1.0), _x(*W), None, "none"),
            RuntimeError,
            r"x must have shape \(\*, in_features\), got a 0-d tensor",
        ),
        (
            "1-D weight",
            lambda: (_x(3, 4), _x(4), None, "none"),
            RuntimeError,
            r"weight must be 2-D \(out_features, in_features\), got 1-D",
        ),
        (
            "3-D weight",
            lambda: (_x(3, 4), _x(1, 5, 4), None, "none"),
            RuntimeError,
            r"weight must be 2-D \(out_features, in_features\), got 3-D",
        ),
        (
            "in_features mismatch",
            lambda: (_x(3, 4), _x(5, 3), None, "none"),
            RuntimeError,
            r"weight has shape \[?\(?5, 3\]?\)? and expects 3 input features, but its input has 4",
        ),
        (
            "bias wrong length",
            lambda: (_x(3, 4), _x(*W), _x(4), "none"),
            RuntimeError,
            r"bias must have shape \(5\), got \[?\(?4",
        ),
        (
            "bias 2-D",
            lambda: (_x(3, 4), _x(*W), _x(1, 5), "none"),
            RuntimeError,
            r"bias must have shape \(5\), got \[?\(?1, 5",
        ),
        (
            "weight dtype",
            lambda: (_x(3, 4), _x(*W, dtype=torch.float64), None, "none"),
            RuntimeError,
            r"weight has dtype (Double|torch.float64) but x has dtype",
        ),
        (
            "bias dtype",
            lambda: (_x(3, 4), _x(*W), _x(5, dtype=torch.float64), "none"),
            RuntimeError,
            r"bias has dtype (Double|torch.float64) but x has dtype",
        ),
        (
            "weight on meta",
            lambda: (_x(3, 4), _x(*W, device="meta"), None, "none"),
            RuntimeError,
            r"weight is on meta but x is on cpu; all tensors must be on one device",
        ),
        (
            "x on meta",
            lambda: (_x(3, 4, device="meta"), _x(*W), None, "none"),
            RuntimeError,
            r"weight is on cpu but x is on meta",
        ),
        (
            "bias on meta",
            lambda: (_x(3, 4), _x(*W), _x(5, device="meta"), "none"),
            RuntimeError,
            r"bias is on meta but x is on cpu",
        ),
        (
            "unknown activation",
            lambda: (_x(3, 4), _x(*W), None, "tanh"),
            ValueError,
            r"unknown activation 'tanh'; " + VALID_NAMES,
        ),
        ("empty activation", lambda: (_x(3, 4), _x(*W), None, ""), ValueError, VALID_NAMES),
        (
            "huge rows x out overflow",
            lambda: (_huge_x(), _x(4, 1), None, "relu"),
            RuntimeError,
            r"x has 4611686018427387904 rows and weight has 4 output features: .* more elements "
            r"than int64 can count",
        ),
        (
            "huge meta overflow",
            lambda: (_x(2**40, 4, device="meta"), _x(2**30, 4, device="meta"), None, "none"),
            RuntimeError,
            r"x has 1099511627776 rows and the weights have 1073741824 output features: the output "
            r"and saved activations would have more elements than int64 can count",
        ),
    ]
    for dtype, name in [
        (torch.int32, "Int"),
        (torch.int64, "Long"),
        (torch.bool, "Bool"),
        (torch.complex64, "ComplexFloat"),
        (torch.float16, "Half"),
        (torch.uint8, "Byte"),
    ]:
        rows.append(
            (
                f"{name} dtype",
                lambda dtype=dtype: (_x(3, 4).to(dtype), _x(*W).to(dtype), None, "none"),
                TypeError,
                dtype_msg.format(name),
            )
        )
    return rows


LINEAR_CASES = [
    Case(f"{entry}: {row_id}", lambda call=call, make=make: call(*make()), error, match)
    for entry, call in LINEAR_ENTRIES.items()
    for row_id, make, error, match in _linear_rows()
]


# ---- mlp ----

MlpCall = Callable[[Tensor, list, list, str], object]
MLP_ENTRIES: dict[str, MlpCall] = {
    "fusedmlp.mlp": lambda x, ws, bs, act: fusedmlp.mlp(x, ws, bs or None, act),
    "ops.mlp": lambda x, ws, bs, act: ops.mlp(x, ws, bs, act),
    "ops.mlp_train": lambda x, ws, bs, act: ops.mlp_train(x, ws, bs, act),
}


def _mlp_rows() -> list[Row]:
    """(id, () -> (x, weights, biases, activation), error, message pattern). Errors the Python
    front end raises itself are ValueError; the op's are RuntimeError: both are accepted."""
    two = lambda: [_x(5, 4), _x(2, 5)]  # noqa: E731
    return [
        (
            "no weights",
            lambda: (_x(3, 4), [], [], "relu"),
            (ValueError, RuntimeError),
            r"weights must hold at least one weight",
        ),
        (
            "bias count",
            lambda: (_x(3, 4), two(), [_x(5)], "relu"),
            (ValueError, RuntimeError),
            r"got 2 weights but 1 biases",
        ),
        (
            "layer 1 in_features",
            lambda: (_x(3, 4), [_x(5, 4), _x(2, 4)], [], "relu"),
            RuntimeError,
            r"weight\[1\] has shape \[?\(?2, 4\]?\)? and expects 4 input features, "
            r"but its input has 5",
        ),
        (
            "layer 0 rank",
            lambda: (_x(3, 4), [_x(4), _x(2, 5)], [], "relu"),
            RuntimeError,
            r"weight\[0\] must be 2-D",
        ),
        (
            "bias[1] length",
            lambda: (_x(3, 4), two(), [_x(5), _x(3)], "relu"),
            RuntimeError,
            r"bias\[1\] must have shape \(2\), got \[?\(?3",
        ),
        (
            "layer 1 dtype",
            lambda: (_x(3, 4), [_x(5, 4), _x(2, 5, dtype=torch.float64)], [], "relu"),
            RuntimeError,
            r"weight\[1\] has dtype (Double|torch.float64) but x has dtype",
        ),
        (
            "bias[0] dtype",
            lambda: (_x(3, 4), two(), [_x(5, dtype=torch.float64), _x(2)], "relu"),
            RuntimeError,
            r"bias\[0\] has dtype (Double|torch.float64) but x has dtype",
        ),
        (
            "layer 1 on meta",
            lambda: (_x(3, 4), [_x(5, 4), _x(2, 5, device="meta")], [], "relu"),
            RuntimeError,
            r"weight\[1\] is on meta but x is on cpu",
        ),
        (
            "unknown activation",
            lambda: (_x(3, 4), two(), [], "swish"),
            ValueError,
            r"unknown activation 'swish'; " + VALID_NAMES,
        ),
        (
            "0-d x",
            lambda: (torch.tensor(1.0), two(), [], "relu"),
            RuntimeError,
            r"x must have shape \(\*, in_features\), got a 0-d tensor",
        ),
        (
            "Int dtype",
            lambda: (_x(3, 4).int(), [w.int() for w in two()], [], "relu"),
            TypeError,
            r"x has dtype Int, but on cpu only Float, Double, BFloat16 are supported",
        ),
        (
            "complex dtype",
            lambda: (_x(3, 4).cfloat(), [w.cfloat() for w in two()], [], "relu"),
            TypeError,
            r"x has dtype ComplexFloat, but on cpu only",
        ),
        (
            "saved size overflow",
            lambda: (_huge_x(), [_x(1, 1) for _ in range(4)] + [_x(0, 1)], [], "relu"),
            RuntimeError,
            r"x has 4611686018427387904 rows and weight\[0\] has 1 output features: "
            r"the output and saved activations would have more elements than int64 can count",
        ),
    ]


MLP_CASES = [
    Case(f"{entry}: {row_id}", lambda call=call, make=make: call(*make()), error, match)
    for entry, call in MLP_ENTRIES.items()
    for row_id, make, error, match in _mlp_rows()
]


# ---- gated_mlp ----

GatedCall = Callable[..., object]
GATED_ENTRIES: dict[str, GatedCall] = {
    "fusedmlp.gated_mlp": lambda x, g, u, d, bg, bu, bd, act: fusedmlp.gated_mlp(
        x, g, u, d, act, bg, bu, bd
    ),
    "ops.gated_mlp": lambda *args: ops.gated_mlp(*args),
    "ops.gated_mlp_train": lambda *args: ops.gated_mlp_train(*args),
}


def _gated(
    x: Tensor | None = None,
    w_gate: Tensor | None = None,
    w_up: Tensor | None = None,
    w_down: Tensor | None = None,
    bias_gate: Tensor | None = None,
    bias_up: Tensor | None = None,
    bias_down: Tensor | None = None,
    activation: str = "gelu_tanh",
) -> tuple:
    """Arguments of a valid (dim 4, hidden 6) gated block, with some replaced."""
    return (
        _x(3, 4) if x is None else x,
        _x(6, 4) if w_gate is None else w_gate,
        _x(6, 4) if w_up is None else w_up,
        _x(4, 6) if w_down is None else w_down,
        bias_gate,
        bias_up,
        bias_down,
        activation,
    )


def _gated_rows() -> list[Row]:
    return [
        (
            "w_gate in_features",
            lambda: _gated(w_gate=_x(6, 3)),
            RuntimeError,
            r"w_gate has shape \[?\(?6, 3\]?\)? and expects 3 input features, but its input has 4",
        ),
        (
            "w_up hidden",
            lambda: _gated(w_up=_x(7, 4)),
            RuntimeError,
            r"w_gate has shape \[?\(?6, 4\]?\)? but w_up has shape \[?\(?7, 4\]?\)?; both must be "
            r"\(hidden, dim\)",
        ),
        (
            "w_down in_features",
            lambda: _gated(w_down=_x(4, 7)),
            RuntimeError,
            r"w_down has shape \[?\(?4, 7\]?\)? and expects 7 input features, but its input has 6",
        ),
        ("w_down rank", lambda: _gated(w_down=_x(4, 6, 1)), RuntimeError, r"w_down must be 2-D"),
        (
            "bias_gate length",
            lambda: _gated(bias_gate=_x(5)),
            RuntimeError,
            r"bias_gate must have shape \(6\), got \[?\(?5",
        ),
        (
            "bias_up length",
            lambda: _gated(bias_up=_x(4)),
            RuntimeError,
            r"bias_up must have shape \(6\), got \[?\(?4",
        ),
        (
            "bias_down length",
            lambda: _gated(bias_down=_x(6)),
            RuntimeError,
            r"bias_down must have shape \(4\), got \[?\(?6",
        ),
        (
            "w_down dtype",
            lambda: _gated(w_down=_x(4, 6, dtype=torch.float64)),
            RuntimeError,
            r"w_down has dtype (Double|torch.float64) but x has dtype",
        ),
        (
            "bias_up dtype",
            lambda: _gated(bias_up=_x(6, dtype=torch.bfloat16)),
            RuntimeError,
            r"bias_up has dtype (BFloat16|torch.bfloat16) but x has dtype",
        ),
        (
            "w_down on meta",
            lambda: _gated(w_down=_x(4, 6, device="meta")),
            RuntimeError,
            r"w_down is on meta but x is on cpu",
        ),
        (
            "bias_up on meta",
            lambda: _gated(bias_up=_x(6, device="meta")),
            RuntimeError,
            r"bias_up is on meta but x is on cpu",
        ),
        (
            "0-d x",
            lambda: _gated(x=torch.tensor(1.0)),
            RuntimeError,
            r"x must have shape \(\*, in_features\), got a 0-d tensor",
        ),
        (
            "Long dtype",
            lambda: tuple(a.long() if isinstance(a, Tensor) else a for a in _gated()),
            TypeError,
            r"x has dtype Long, but on cpu only Float, Double, BFloat16 are supported",
        ),
        (
            "unknown activation",
            lambda: _gated(activation="geglu"),
            ValueError,
            r"unknown activation 'geglu'; " + VALID_NAMES,
        ),
        (
            "saved size overflow",
            lambda: _gated(x=_huge_x(), w_gate=_x(4, 1), w_up=_x(4, 1), w_down=_x(1, 4)),
            RuntimeError,
            r"x has 4611686018427387904 rows and w_gate has 4 output features: "
            r"the saved gate, up and product activations would have more elements than int64",
        ),
        (
            "meta saved size overflow",
            lambda: _gated(
                x=_x(2**40, 4, device="meta"),
                w_gate=_x(2**30, 4, device="meta"),
                w_up=_x(2**30, 4, device="meta"),
                w_down=_x(4, 2**30, device="meta"),
            ),
            RuntimeError,
            r"x has 1099511627776 rows and w_gate has 1073741824 output features: the saved gate",
        ),
        (
            "output size overflow",
            lambda: _gated(
                x=torch.randn(1, 1).expand(2**61, 1),
                w_gate=_x(1, 1),
                w_up=_x(1, 1),
                w_down=torch.randn(1, 1).expand(8, 1),
            ),
            RuntimeError,
            r"x has 2305843009213693952 rows and w_down has 8 output features: "
            r"the output would have more elements than int64 can count",
        ),
    ]


GATED_CASES = [
    Case(f"{entry}: {row_id}", lambda call=call, make=make: call(*make()), error, match)
    for entry, call in GATED_ENTRIES.items()
    for row_id, make, error, match in _gated_rows()
]


# ---- the backward ops ----


def _grad(dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(3, 5).to(dtype)


POINTWISE_CASES = [
    Case(
        "ops.activation_backward: pre shape",
        lambda: ops.activation_backward(_grad(), _x(3, 4), "relu"),
        RuntimeError,
        r"pre must have the shape of grad, \[?\(?3, 5\]?\)?, got \[?\(?3, 4",
    ),
    Case(
        "ops.activation_backward: pre dtype",
        lambda: ops.activation_backward(_grad(), _grad(torch.float64), "relu"),
        RuntimeError,
        r"pre has dtype Double but grad has dtype Float",
    ),
    Case(
        "ops.activation_backward: pre on meta",
        lambda: ops.activation_backward(_grad(), _grad().to("meta"), "relu"),
        RuntimeError,
        r"pre must share the dtype and device of grad",
    ),
    Case(
        "ops.activation_backward: unknown activation",
        lambda: ops.activation_backward(_grad(), _grad(), "elu"),
        ValueError,
        r"unknown activation 'elu'; " + VALID_NAMES,
    ),
    Case(
        "ops.gated_backward: up shape",
        lambda: ops.gated_backward(_grad(), _grad(), _x(3, 4), "silu"),
        RuntimeError,
        r"up must have the shape of grad_product, \[?\(?3, 5\]?\)?, got \[?\(?3, 4",
    ),
    Case(
        "ops.gated_backward: gate dtype",
        lambda: ops.gated_backward(_grad(), _grad(torch.bfloat16), _grad(), "silu"),
        RuntimeError,
        r"gate has dtype BFloat16 but grad_product has dtype Float",
    ),
    Case(
        "ops.gated_backward: unknown activation",
        lambda: ops.gated_backward(_grad(), _grad(), _grad(), "prelu"),
        ValueError,
        r"unknown activation 'prelu'; " + VALID_NAMES,
    ),
    # The kernels read numel() floats from every tensor: a 1- or 2-byte dtype used to make
    # them read past the end of the buffer (a segfault for large tensors).
    *[
        Case(
            f"ops.activation_backward: {name} dtype",
            lambda dtype=dtype: ops.activation_backward(_grad(dtype), _grad(dtype), "relu"),
            TypeError,
            rf"grad has dtype {name}, but on cpu only Float, Double, BFloat16",
        )
        for dtype, name in [
            (torch.uint8, "Byte"),
            (torch.float16, "Half"),
            (torch.int32, "Int"),
            (torch.complex64, "ComplexFloat"),
        ]
    ],
    *[
        Case(
            f"ops.gated_backward: {name} dtype",
            lambda dtype=dtype: ops.gated_backward(*[_grad(dtype)] * 3, "relu"),
            TypeError,
            rf"grad_product has dtype {name}, but on cpu only Float, Double",
        )
        for dtype, name in [(torch.int8, "Char"), (torch.float16, "Half"), (torch.int64, "Long")]
    ],
]


def _chain_backward(**changes: object) -> object:
    """fusedmlp::chain_backward on a valid 2-layer ReLU mlp's saved buffer, with `changes`
    to its arguments."""
    x, weights = _x(3, 4), [_x(5, 4), _x(2, 5)]
    y, saved = ops.mlp_train(x, weights, [], "relu")
    args = {
        "grad_y": torch.ones_like(y), "x": x, "weights": weights, "saved": saved, "y": None,
        "bias": False, "hidden_activation": "relu", "final_activation": "none",
        "need_grad_x": True,
    }
    args.update(changes)
    return ops.chain_backward(*args.values())


CHAIN_BACKWARD_CASES = [
    Case(
        f"ops.chain_backward: {case_id}", lambda changes=changes: _chain_backward(**changes),
        error, match,
    )
    for case_id, changes, error, match in [
        ("grad_y shape", {"grad_y": _x(3, 5)}, RuntimeError,
         r"grad_y must have the output's shape \[3, 2\], got \[3, 5\]"),
        ("grad_y dtype", {"grad_y": _x(3, 2, dtype=torch.float64)}, RuntimeError,
         r"grad_y has dtype Double but x has dtype Float"),
        ("grad_y on meta", {"grad_y": _x(3, 2, device="meta")}, RuntimeError,
         r"grad_y is on meta but x is on cpu"),
        ("saved length", {"saved": _x(14)}, RuntimeError,
         r"saved must be the 1-D buffer of 15 elements .* got shape \[14\]"),
        ("saved for other activations", {"final_activation": "gelu"}, RuntimeError,
         r"saved must be the 1-D buffer of 21 elements"),
        ("saved dtype", {"saved": _x(15, dtype=torch.bfloat16)}, RuntimeError,
         r"saved has dtype BFloat16 but x has dtype Float"),
        ("y missing where a final relu reads it", {"final_activation": "relu"}, RuntimeError,
         r"y \(the forward's output\) is required: the derivative of the final activation "
         r"'relu' reads it"),
        ("y shape", {"final_activation": "relu", "y": _x(3, 5)}, RuntimeError,
         r"y must have the output's shape \[3, 2\], got \[3, 5\]"),
        ("y dtype", {"y": _x(3, 2, dtype=torch.float64)}, RuntimeError,
         r"y has dtype Double but x has dtype Float"),
        ("weight chain", {"weights": [_x(5, 4), _x(2, 6)]}, RuntimeError,
         r"weight\[1\] has shape \[2, 6\] and expects 6 input features, but its input has 5"),
        ("unknown activation", {"hidden_activation": "elu"}, ValueError,
         r"unknown activation 'elu'; " + VALID_NAMES),
        ("Half x", {"x": _x(3, 4, dtype=torch.float16)}, TypeError,
         r"x has dtype Half, but on cpu only Float, Double, BFloat16"),
    ]
]


def _gated_mlp_backward(**changes: object) -> object:
    """fusedmlp::gated_mlp_backward on a valid gated block's saved buffer, with `changes`
    to its arguments."""
    x, w_gate, w_up, w_down = _x(3, 4), _x(6, 4), _x(6, 4), _x(2, 6)
    y, saved = ops.gated_mlp_train(x, w_gate, w_up, w_down, None, None, None, "silu")
    args = {
        "grad_y": torch.ones_like(y), "x": x, "w_gate": w_gate, "w_up": w_up,
        "w_down": w_down, "saved": saved, "bias": [False] * 3, "activation": "silu",
        "need_grad_x": True,
    }
    args.update(changes)
    return ops.gated_mlp_backward(*args.values())


GATED_BACKWARD_CASES = [
    Case(
        f"ops.gated_mlp_backward: {case_id}",
        lambda changes=changes: _gated_mlp_backward(**changes), error, match,
    )
    for case_id, changes, error, match in [
        ("grad_y shape", {"grad_y": _x(3, 4)}, RuntimeError,
         r"grad_y must have the output's shape \[3, 2\], got \[3, 4\]"),
        ("saved shape", {"saved": _x(3, 3, 5)}, RuntimeError,
         r"saved must have shape \[3, 3, 6\] \(gate, up, product\), got \[3, 3, 5\]"),
        ("saved dtype", {"saved": _x(3, 3, 6, dtype=torch.float64)}, RuntimeError,
         r"saved has dtype Double but x has dtype Float"),
        ("w_up shape", {"w_up": _x(5, 4)}, RuntimeError,
         r"w_gate has shape \[6, 4\] but w_up has shape \[5, 4\]"),
        ("two bias flags", {"bias": [True, False]}, RuntimeError,
         r"List with 2 elements to a fixed-size array of size 3"),
        ("unknown activation", {"activation": "tanh"}, ValueError,
         r"unknown activation 'tanh'; " + VALID_NAMES),
    ]
]


# ---- modules, convert and non-Tensor arguments ----

MODULE_CASES = [
    Case(
        "FusedLinear(activation=)",
        lambda: fusedmlp.FusedLinear(4, 5, activation="x"),
        ValueError,
        r"unknown activation 'x'; " + VALID_NAMES,
    ),
    Case(
        "FusedLinear forward: in_features",
        lambda: fusedmlp.FusedLinear(4, 5)(_x(3, 3)),
        RuntimeError,
        r"weight has shape \[?\(?5, 4\]?\)? and expects 4 input features, but its input has 3",
    ),
    Case(
        "FusedLinear forward: x dtype",
        lambda: fusedmlp.FusedLinear(4, 5)(_x(3, 4).double()),
        RuntimeError,
        r"weight has dtype (Float|torch.float32) but x has dtype",
    ),
    Case(
        "FusedLinear forward: Int x",
        lambda: fusedmlp.FusedLinear(4, 5)(_x(3, 4).int()),
        TypeError,
        r"x has dtype Int, but on cpu only",
    ),
    Case(
        "FusedLinear forward: 0-d x",
        lambda: fusedmlp.FusedLinear(4, 5)(torch.tensor(1.0)),
        RuntimeError,
        r"x must have shape \(\*, in_features\)",
    ),
    Case(
        "FusedLinear forward: x on meta",
        lambda: fusedmlp.FusedLinear(4, 5)(_x(3, 4, device="meta")),
        RuntimeError,
        r"is on cpu but x is on meta",
    ),
    Case(
        "FusedLinear(-1, 5), as nn.Linear",
        lambda: fusedmlp.FusedLinear(-1, 5),
        RuntimeError,
        r"negative dimension",
    ),
    Case(
        "FusedLinear.from_linear(not Linear)",
        lambda: fusedmlp.FusedLinear.from_linear(nn.ReLU()),
        TypeError,
        r"from_linear expects an nn.Linear, got ReLU",
    ),
    Case(
        "FusedMLP(sizes too short)",
        lambda: fusedmlp.FusedMLP([4]),
        ValueError,
        r"FusedMLP needs sizes \[in, ..., out\] of length >= 2, got \[4\]",
    ),
    Case(
        "FusedMLP(activation=)",
        lambda: fusedmlp.FusedMLP([4, 2], activation="tanh"),
        ValueError,
        VALID_NAMES,
    ),
    Case(
        "FusedMLP forward: in_features",
        lambda: fusedmlp.FusedMLP([4, 2, 3])(_x(3, 5)),
        RuntimeError,
        r"weight\[0\] has shape \[?\(?2, 4\]?\)? and expects 4 input features",
    ),
    Case(
        "FusedMLP forward: complex x",
        lambda: fusedmlp.FusedMLP([4, 2, 3])(_x(3, 4).cfloat()),
        TypeError,
        r"x has dtype ComplexFloat, but on cpu only",
    ),
    Case(
        "FusedMLP forward: x on meta",
        lambda: fusedmlp.FusedMLP([4, 2, 3])(_x(3, 4, device="meta")),
        RuntimeError,
        r"weight\[0\] is on cpu but x is on meta",
    ),
    Case(
        "FusedMLP.from_sequential(bad chain)",
        lambda: fusedmlp.FusedMLP.from_sequential(
            nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
        ),
        ValueError,
        r"from_sequential expects nn.Sequential\(nn.Linear, Act",
    ),
    Case(
        "FusedGatedMLP(activation=)",
        lambda: fusedmlp.FusedGatedMLP(4, 6, activation="relu6"),
        ValueError,
        VALID_NAMES,
    ),
    Case(
        "FusedGatedMLP forward: in_features",
        lambda: fusedmlp.FusedGatedMLP(4, 6)(_x(3, 5)),
        RuntimeError,
        r"w_gate has shape \[?\(?6, 4\]?\)? and expects 4 input features, but its input has 5",
    ),
    Case(
        "FusedGatedMLP forward: float16 x",
        lambda: fusedmlp.FusedGatedMLP(4, 6, dtype=torch.float16)(_x(3, 4).half()),
        TypeError,
        r"x has dtype Half, but on cpu only Float, Double, BFloat16 are supported",
    ),
    Case(
        "FusedGatedMLP forward: bf16 x, float32 module",
        lambda: fusedmlp.FusedGatedMLP(4, 6)(_x(3, 4).bfloat16()),
        RuntimeError,
        r"w_gate has dtype Float but x has dtype BFloat16",
    ),
    Case(
        "convert(not a Module)",
        lambda: fusedmlp.convert(5),
        TypeError,
        r"model must be an nn.Module, got int",
    ),
    Case(
        "linear(x=list)",
        lambda: fusedmlp.linear([1.0], _x(*W)),
        TypeError,
        r"x must be a Tensor, got list",
    ),
    Case(
        "linear(bias=list)",
        lambda: fusedmlp.linear(_x(3, 4), _x(*W), [1.0] * 5),
        TypeError,
        r"bias must be a Tensor or None, got list",
    ),
    Case(
        "ops.linear(x=list)",
        lambda: ops.linear([1.0], _x(*W), None, "none"),
        RuntimeError,
        r"Expected a value of type 'Tensor' for argument 'x'",
    ),
    Case(
        "mlp(weights=Tensor)",
        lambda: fusedmlp.mlp(_x(3, 4), _x(2, 4)),
        TypeError,
        r"weights and biases must be sequences of Tensors, not a Tensor",
    ),
    Case(
        "mlp(biases=[list])",
        lambda: fusedmlp.mlp(_x(3, 4), [_x(2, 4)], [[0.0, 0.0]]),
        TypeError,
        r"biases\[0\] must be a Tensor or None, got list",
    ),
    Case(
        "gated_mlp(bias_up=list)",
        lambda: fusedmlp.gated_mlp(*_gated()[:4], bias_up=[0.0] * 6),
        TypeError,
        r"bias_up must be a Tensor or None, got list",
    ),
    Case(
        "gated_mlp(w_down=None)",
        lambda: fusedmlp.gated_mlp(_x(3, 4), _x(6, 4), _x(6, 4), None),
        TypeError,
        r"w_down must be a Tensor, got NoneType",
    ),
]

ALL_CASES = (
    LINEAR_CASES + MLP_CASES + GATED_CASES + POINTWISE_CASES + CHAIN_BACKWARD_CASES
    + GATED_BACKWARD_CASES + MODULE_CASES
)


def _still_works() -> None:
    """A valid call after an error: the process (and the op registry) is still usable."""
    x, w, b = _x(3, 4, dtype=torch.float64), _x(*W, dtype=torch.float64), _x(5, dtype=torch.float64)
    torch.testing.assert_close(fusedmlp.linear(x, w, b, "relu"), F.relu(F.linear(x, w, b)))


def _raised_by(case: Case) -> ErrorTypes:
    """A direct op call reaches a kernel registered through LibTorch's stable ABI, which
    raises every error as RuntimeError (docs/limits.md): where the front end raises
    TypeError or ValueError, the op raises RuntimeError with the same message."""
    if case.id.startswith("ops.") and case.error in (TypeError, ValueError):
        return (case.error, RuntimeError)
    return case.error


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_bad_input(case: Case) -> None:
    with pytest.raises(_raised_by(case), match=case.match):
        case.call()
    _still_works()


def test_bad_inputs_under_autograd() -> None:
    """The checks also run (first) when inputs require grad, through the autograd kernel."""
    x = _x(3, 4, dtype=torch.float64).requires_grad_()
    with pytest.raises(RuntimeError, match=r"weight has dtype Float but x has dtype Double"):
        fusedmlp.linear(x, _x(*W))
    with pytest.raises(RuntimeError, match=r"weight\[1\] is on meta but x is on cpu"):
        fusedmlp.mlp(x, [_x(5, 4, dtype=torch.float64), _x(2, 5, device="meta").double()])
    _still_works()


def test_errors_under_torch_compile() -> None:
    """Under torch.compile the fake kernels raise the same message as the real ones."""
    compiled = torch.compile(lambda x, w: fusedmlp.linear(x, w, None, "relu"), fullgraph=True)
    with pytest.raises(Exception, match=r"expects 3 input features, but its input has 4"):
        compiled(_x(3, 4), _x(5, 3))
    _still_works()


def test_fake_kernels_refuse_what_the_real_ones_do() -> None:
    """FakeTensorMode, which torch.compile traces with, runs the fake kernels: they refuse an
    unsupported dtype and name the op and argument as the real kernels do."""
    with FakeTensorMode():
        half = torch.empty(3, 5, dtype=torch.float16)
        with pytest.raises(TypeError, match=r"fusedmlp.activation_backward: grad has dtype"):
            ops.activation_backward(half, half, "relu")
        grad = torch.empty(3, 5)
        with pytest.raises(RuntimeError, match=r"up must have the shape of grad_product"):
            ops.gated_backward(grad, grad, torch.empty(3, 4), "silu")
        x, w_gate, w_down = torch.empty(3, 4), torch.empty(6, 4), torch.empty(2, 6)
        with pytest.raises(RuntimeError, match=r"fusedmlp.gated_mlp_backward: w_gate has shape"):
            ops.gated_mlp_backward(
                torch.empty(3, 2), x, w_gate, torch.empty(5, 4), w_down, torch.empty(3, 3, 6),
                [False] * 3, "silu", True,
            )


def test_mixed_meta_and_cpu_is_an_error_like_aten_is_not() -> None:
    """Documents why we check: ATen's own F.linear silently accepts a meta weight with a CPU
    input (returning a CPU tensor); fusedmlp raises a clear device error instead."""
    aten = F.linear(_x(3, 4), _x(*W, device="meta"))
    assert aten.device.type in ("cpu", "meta")
    with pytest.raises(RuntimeError, match="all tensors must be on one device"):
        fusedmlp.linear(_x(3, 4), _x(*W, device="meta"))


def test_meta_device_alone_works() -> None:
    """All-meta inputs are fine: shapes only, as for any PyTorch op."""
    y = fusedmlp.mlp(_x(7, 2, 4, device="meta"), [_x(5, 4, device="meta"), _x(3, 5, device="meta")])
    assert y.device.type == "meta" and y.shape == (7, 2, 3)
    y = fusedmlp.FusedGatedMLP(4, 6, device="meta")(_x(2**40, 4, device="meta"))
    assert y.shape == (2**40, 4)


# ---- NaN and Inf propagate as in PyTorch ----

SPECIAL = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.0, -1.0, 1e30, -1e30, 30.0, -30.0]
ACTIVATIONS = list(fusedmlp.ACTIVATIONS)
REFERENCE = {
    "none": nn.Identity(),
    "relu": nn.ReLU(),
    "gelu": nn.GELU(),
    "gelu_tanh": nn.GELU(approximate="tanh"),
    "silu": nn.SiLU(),
}


def _special_column(dtype: torch.dtype) -> Tensor:
    return torch.tensor(SPECIAL, dtype=torch.float64).to(dtype).reshape(-1, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_special_values_forward(activation: str, dtype: torch.dtype) -> None:
    """act(x * 1) at NaN, +-Inf, +-0 and huge values: same NaN positions, infinities and values
    as PyTorch's float64 reference (torch's own float32 GELU returns NaN at +Inf and Inf at
    3e38, a vectorisation artefact; the float64 reference gives Inf and 3e38, as we do)."""
    x = _special_column(dtype)
    y = fusedmlp.linear(x, torch.ones(1, 1, dtype=dtype), activation=activation)
    expected = REFERENCE[activation](x.double())
    torch.testing.assert_close(y.double(), expected, equal_nan=True, rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_special_values_backward(activation: str, dtype: torch.dtype) -> None:
    """Gradients at NaN, +-Inf, +-0 and huge pre-activations match PyTorch's in the same
    precision: whether an intermediate overflows depends on it (float32 tanh-GELU's gradient
    is NaN at 1e30 because z**3 overflows -- in torch too -- while float64's is 1)."""
    x = _special_column(dtype).requires_grad_()
    w = torch.ones(1, 1, dtype=dtype, requires_grad=True)
    grads = torch.autograd.grad(fusedmlp.linear(x, w, activation=activation).sum(), (x, w))
    x_ref = x.detach().clone().requires_grad_()
    w_ref = w.detach().clone().requires_grad_()
    reference = REFERENCE[activation](F.linear(x_ref, w_ref)).sum()
    expected = torch.autograd.grad(reference, (x_ref, w_ref))
    for actual, wanted in zip(grads, expected):
        torch.testing.assert_close(actual, wanted, equal_nan=True)


@pytest.mark.parametrize("where", ["x", "weight", "bias"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_operand_propagates_through_mlp(where: str, value: float) -> None:
    """One NaN/Inf in x, a weight or a bias spreads through the matmuls exactly as in
    nn.Sequential(Linear, GELU, Linear): same non-finite positions, same finite values."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    weights = [
        torch.randn(7, 5, generator=generator, dtype=torch.float64),
        torch.randn(3, 7, generator=generator, dtype=torch.float64),
    ]
    biases = [
        torch.randn(7, generator=generator, dtype=torch.float64),
        torch.randn(3, generator=generator, dtype=torch.float64),
    ]
    target = {"x": x, "weight": weights[0], "bias": biases[0]}[where]
    target.view(-1)[2] = value
    actual = fusedmlp.mlp(x, weights, biases, "gelu")
    expected = F.linear(F.gelu(F.linear(x, weights[0], biases[0])), weights[1], biases[1])
    torch.testing.assert_close(actual, expected, equal_nan=True)
    assert actual.isnan().any() or actual.isinf().any()


def test_nan_in_gated_mlp_matches_pytorch() -> None:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    x[1, 3] = math.nan
    x[2, 0] = math.inf
    w_gate, w_up = (torch.randn(8, 6, generator=generator, dtype=torch.float64) for _ in range(2))
    w_down = torch.randn(6, 8, generator=generator, dtype=torch.float64)
    actual = fusedmlp.gated_mlp(x, w_gate, w_up, w_down, "silu")
    expected = F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)
    torch.testing.assert_close(actual, expected, equal_nan=True)
    assert actual[1].isnan().all() and actual[0].isfinite().all()


# ---- double backward: refused with a clear error, never silently wrong ----


def _double_backward_calls() -> dict[str, Callable[[Tensor], Tensor]]:
    w = _x(5, 4, dtype=torch.float64).requires_grad_()
    w2 = _x(2, 5, dtype=torch.float64)
    g, u, d = (_x(*s, dtype=torch.float64) for s in ((6, 4), (6, 4), (4, 6)))
    return {
        "linear-relu": lambda x: fusedmlp.linear(x, w, None, "relu"),
        "linear-gelu": lambda x: fusedmlp.linear(x, w, None, "gelu"),
        "mlp-none": lambda x: fusedmlp.mlp(x, [w, w2], None, "none"),
        "mlp-relu": lambda x: fusedmlp.FusedMLP([4, 5, 2], dtype=torch.float64)(x),
        "gated-none": lambda x: fusedmlp.gated_mlp(x, g, u, d, "none"),
    }


@pytest.mark.parametrize("name", list(_double_backward_calls()))
def test_double_backward_is_refused(name: str) -> None:
    """The backward reads saved activations autograd cannot see through: second-order
    gradients would lose terms (they did, silently, before this check)."""
    x = _x(3, 4, dtype=torch.float64).requires_grad_()
    y = _double_backward_calls()[name](x)
    with pytest.raises(RuntimeError, match=r"double backward \(create_graph=True\) is not supp"):
        torch.autograd.grad(y.square().sum(), x, create_graph=True)
    # First-order gradients are unaffected.
    y = _double_backward_calls()[name](x)
    assert torch.autograd.grad(y.square().sum(), x)[0].shape == x.shape


def test_double_backward_of_plain_linear_is_exact() -> None:
    """One layer without activation differentiates only through x and weight: allowed."""
    x, w, b = (_x(*s, dtype=torch.float64).requires_grad_() for s in ((3, 4), W, (5,)))
    assert torch.autograd.gradgradcheck(lambda x, w, b: fusedmlp.linear(x, w, b), (x, w, b))
