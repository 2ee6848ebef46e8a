"""Evaluation: the methods of the protocol, their metrics and the report.

`registry` defines what a method is and resolves names, the built-in ones from the registries of
`ilcp.names`; `methods` (the built-in methods), `rclc_methods` (the ``rclc:...`` family) and
`kv_relay` (the ``kv_relay:...`` comparison rows) implement them. Importing this package imports
every family.
"""

from . import kv_relay, methods, rclc_methods  # noqa: F401  (the families, as attributes of the package)
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
