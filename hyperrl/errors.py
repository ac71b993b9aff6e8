"""The one base of hyperrl's own errors: ``except HyperRLError`` catches every error the library raises on purpose
(a refused config, a gate, a publication, a checkpoint, a plan), each also a subclass of the builtin it refines
(``ValueError``, ``RuntimeError``, …) so existing ``except`` clauses keep working."""

from __future__ import annotations

__all__ = ["HyperRLError"]


class HyperRLError(Exception):
    """Base of every error class hyperrl defines; the message names the offending key, value or file and the fix."""
