"""Evaluation: the methods of the protocol, their metrics and the report."""
