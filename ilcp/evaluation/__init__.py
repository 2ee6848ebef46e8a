"""Evaluation: the methods of the protocol, their metrics and the report.

`registry` defines what a method is and resolves names; `methods` (the built-in methods) and
`rclc_methods` (the ``rclc:...`` family) and `kv_relay` (the ``kv_relay:...`` comparison rows)
each register their methods there. Importing this package imports every family, so every name
resolves whichever module is imported first.
"""

from . import kv_relay, methods, rclc_methods  # noqa: F401  (registers the built-in methods and the families)
from .methods import DEFAULT_METHODS
from .registry import (Decoded, EvalContext, HandoffMethod, MethodUnavailable, Prefixes, Sent, expand_method_names,
                       make_method, method_groups, method_names, register_group, register_method)

__all__ = [
    "DEFAULT_METHODS",
    "Decoded",
    "EvalContext",
    "HandoffMethod",
    "MethodUnavailable",
    "Prefixes",
    "Sent",
    "expand_method_names",
    "make_method",
    "method_groups",
    "method_names",
    "register_group",
    "register_method",
]
