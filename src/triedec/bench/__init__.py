"""``triedec bench``: methods measured side by side against stock transformers.

``run`` holds the entry points (method entries, the Spec-Bench-style greedy benchmark, the
beam-search benchmark); ``harness`` the greedy protocol and its metrics; ``beam`` the beam-search
protocol; ``datasets`` the questions; ``report`` the written outputs. This package's ``__init__``
imports nothing, so that reading its data (``datasets``) never loads the rest.
"""
