"""The calculator tool of the example (``rlctl grpo --tools examples/calculator/calc.py``).

A plain function with type hints and a Google-style docstring: rlctl builds its JSON schema from them,
as TRL and transformers do. An expression it cannot evaluate raises; the model then reads the error.
"""

from __future__ import annotations

import ast
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, with + - * / and parentheses.
    """
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not an arithmetic expression: {ast.unparse(node)}")
