"""A built-in tool: arithmetic for the model (`rollout.tools: [rltrain.rollout.calculator:calculator]`).

The model's expression is untrusted input: it is parsed with Python's `ast` and only numbers,
+ - * / // % **, unary signs and parentheses are computed, node by node; nothing is evaluated as
code (a name, call, attribute or string is an error the model sees). Sizes are bounded so a hostile
expression cannot take the process's time or memory: the expression's length, its number of
operations, and every integer's size (a power is checked before it is computed).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

MAX_CHARS = 1000  # the expression's length
MAX_OPERATIONS = 200
MAX_DIGITS = 1000  # an integer result's decimal digits (a float's range is its own)

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_WRITTEN = str.maketrans({"×": "*", "÷": "/", "−": "-"})  # the signs models write besides ASCII's


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression: numbers, + - * / // % ** (power) and parentheses.

    Args:
        expression: The expression to compute, e.g. "(12 + 7) * 3 / 4".
    """
    if not isinstance(expression, str):
        raise TypeError(f"expression must be text, not {type(expression).__name__}")
    if len(expression) > MAX_CHARS:
        raise ValueError(f"the expression has {len(expression)} characters; at most {MAX_CHARS}")
    text = expression.translate(_WRITTEN).strip()
    if "^" in text:
        raise ValueError("'^' is not a power here: write ** (2**10)")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an arithmetic expression: {getattr(e, 'msg', type(e).__name__)}") from None
    operations = sum(isinstance(n, (ast.BinOp, ast.UnaryOp)) for n in ast.walk(tree))
    if operations > MAX_OPERATIONS:
        raise ValueError(f"the expression has {operations} operations; at most {MAX_OPERATIONS}")
    return _shown(_value(tree.body))


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        result = _BINARY[type(node.op)](left, right)
        if isinstance(result, complex):
            raise ValueError("the result is not a real number (a negative number to a fractional power)")
        return _checked(result)
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic: numbers, + - * / // % ** and parentheses only")


def _check_power(base: int | float, exponent: int | float) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        digits = exponent * math.log10(abs(base))
        if digits > MAX_DIGITS:
            raise ValueError(f"{base}**{exponent} has about {digits:.0f} digits; at most {MAX_DIGITS}")


def _checked(x: int | float) -> int | float:
    if isinstance(x, int) and x.bit_length() > MAX_DIGITS * 3.33:
        raise ValueError(f"a number in the expression has over {MAX_DIGITS} digits")
    return x


def _shown(x: int | float) -> str:
    """An integer as it is; a float in 12 significant digits (2.0 as 2, 0.1 + 0.2 as 0.3)."""
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            raise ValueError(f"the result is {x}")
        return f"{x:.12g}"
    return str(x)
