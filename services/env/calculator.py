"""The `calculator` tool: arithmetic on numbers, evaluated by walking the expression's AST (never Python's eval)."""

from __future__ import annotations

import ast
import math
import operator
from typing import Any

from services.env.types import ToolError

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS = {"sqrt": math.sqrt, "abs": abs, "round": lambda x: round(x), "floor": math.floor, "ceil": math.ceil,
              "log": math.log, "exp": math.exp, "min": min, "max": max}
_CONSTANTS = {"pi": math.pi, "e": math.e}
MAX_EXPRESSION_CHARS = 1000
# Results past this many digits are refused, so `9**9**9` cannot take the replica's CPU.
MAX_DIGITS = 1000


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ToolError says what is not allowed or what went wrong."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("expression: must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression: longer than {MAX_EXPRESSION_CHARS} characters")
    expression = expression.replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ToolError(f"expression: not arithmetic ({e.msg})") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise ToolError("division by zero") from None
    except (OverflowError, ValueError) as e:
        raise ToolError(f"{type(e).__name__}: {e}") from None


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(_BINARY[type(node.op)](left, right))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords):
        return _bounded(_FUNCTIONS[node.func.id](*[_eval(a) for a in node.args]))
    raise ToolError(f"expression: {type(node).__name__} is not allowed (numbers, + - * / // % **, parentheses "
                    f"and {', '.join(_FUNCTIONS)})")


def _check_power(base, exponent) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if exponent * math.log10(abs(base)) > MAX_DIGITS:
            raise ToolError(f"result has more than {MAX_DIGITS} digits")


def _bounded(value):
    if isinstance(value, int) and value.bit_length() > MAX_DIGITS * 3.33:
        raise ToolError(f"result has more than {MAX_DIGITS} digits")
    return value


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


class Calculator:
    name = "calculator"

    def schema(self) -> dict:
        return {"type": "function", "function": {
            "name": self.name,
            "description": "Evaluates an arithmetic expression (+ - * / // % **, parentheses, sqrt, abs, round).",
            "parameters": {"type": "object", "properties": {
                "expression": {"type": "string", "description": "for example (123 * 456) - 7"}},
                "required": ["expression"]}}}

    async def __call__(self, arguments: dict[str, Any], *, episode_id: str = "") -> str:
        if set(arguments) != {"expression"}:
            raise ToolError(f"arguments: calculator takes exactly {{'expression': str}}, got keys {sorted(arguments)}")
        return format_number(evaluate(arguments["expression"]))

    async def close(self) -> None:
        pass
