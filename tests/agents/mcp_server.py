"""A small MCP server over stdio for the tests (the ``mcp`` SDK's MCPServer; it imports nothing of hyperrl,
so it starts fast): a calculator, a tool that crashes the server, one that outlives its timeout."""

import ast
import operator
import os
import time

from mcp.server.mcpserver import MCPServer

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}

server = MCPServer("hyperrl-test-calculator")


@server.tool()
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (integers, + - *)."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported: {ast.dump(node)[:40]}")
    return str(ev(ast.parse(expression, mode="eval")))


@server.tool()
def crash() -> str:
    """Kill this server (a crash mid-call)."""
    os._exit(1)


@server.tool()
def slow(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "slept"


@server.tool()
def pid() -> str:
    """This server's process id."""
    return str(os.getpid())


if __name__ == "__main__":
    server.run()
