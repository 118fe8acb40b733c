"""What loads a model, as a plain value: :class:`ModelSpec` (a :class:`~triedec.model.source.ModelSource`,
the kernels, torch's CPU threads and a chat template). Built from the command line's model flags
(:mod:`triedec.cli.flags`) by the CLI and by Ray Serve's replicas alike, and importable without torch
(a command's ``--help`` loads nothing)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from triedec.core.errors import TriedecError

if TYPE_CHECKING:
    from triedec.model.source import ModelSource

DEFAULT_THREADS = 2
"""torch's CPU threads unless ``--threads`` or :data:`THREADS_ENV` says otherwise."""
THREADS_ENV = "TRIEDEC_THREADS"
"""The environment variable that, when set, replaces :data:`DEFAULT_THREADS` (as llama-server's
``LLAMA_ARG_THREADS``): every ``triedec`` process a script or a test suite starts gets it."""


def default_threads() -> int:
    """torch's CPU threads when ``--threads`` is not given: :data:`THREADS_ENV`, else
    :data:`DEFAULT_THREADS`."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return DEFAULT_THREADS
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise TriedecError(f"{THREADS_ENV} must be a positive whole number, got {value!r}")
    return threads


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What loads the model: the model flags (a :class:`~triedec.model.source.ModelSource` from ``--model``,
    ``--dtype``, ``--weights``, ``--device``, ``--attn``; ``--kernels``), torch's CPU threads and a chat
    template to use instead of the tokenizer's (its text, read from ``--chat-template`` once). A plain
    value, so that another process (a Ray replica) can load the same model."""

    source: ModelSource | None = None
    """the :class:`~triedec.model.source.ModelSource` (``--model``, ``--dtype``, ``--weights``, ``--device``,
    ``--attn``); None: the embedded default's"""
    kernels: str = "auto"
    threads: int = dataclasses.field(default_factory=default_threads)
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.source is None:
            from triedec.model.source import ModelSource

            object.__setattr__(self, "source", ModelSource())
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise TriedecError(f"--threads must be positive, got {self.threads}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ModelSpec:
        from triedec.model.source import ModelSource

        template = None
        if getattr(args, "chat_template", None):
            try:
                template = Path(args.chat_template).read_text()
            except (OSError, UnicodeDecodeError) as exc:
                raise TriedecError(f"--chat-template {args.chat_template}: cannot read it ({exc})") from exc
            if not template.strip():
                raise TriedecError(f"--chat-template {args.chat_template} is empty")
        source = ModelSource(args.model, args.dtype, args.weights, args.device, args.attn)
        threads = default_threads() if args.threads is None else args.threads
        return cls(source, args.kernels, threads, template)

    def as_flags(self) -> list[str]:
        """The model flags that give this spec back (all but ``--chat-template``, whose text the
        spec holds instead of a file): what a benchmark passes to the servers it starts."""
        source = self.source
        return [*(["--model", str(source.model)] if source.model else []),
                *(["--dtype", str(source.dtype).removeprefix("torch.")] if source.dtype else []),
                "--weights", source.weights, "--device", str(source.device), "--attn", source.attn_implementation,
                "--threads", str(self.threads), "--kernels", self.kernels]

    def check(self) -> None:
        """Raise :class:`~triedec.core.errors.TriedecError` where :meth:`load` would refuse this model
        (a missing path, not a causal LM), without loading it: what a launcher checks before it
        starts the processes that load it (an unsupported ``--attn`` or ``--dtype`` is refused
        when the spec is built)."""
        self.source.check()

    def load(self) -> Any:
        """The :class:`~triedec.api.lm.LM`, with torch's CPU threads set first (on the calling thread's
        behalf: torch's thread count is per process)."""
        import torch

        from triedec.api.loading import load_source

        torch.set_num_threads(self.threads)
        lm = load_source(self.source, self.kernels)
        if self.chat_template is not None:
            lm.tokenizer.chat_template = self.chat_template
            try:  # a broken template fails here, not on a client's request
                lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                 add_generation_prompt=True)
            except Exception as exc:
                raise TriedecError(f"--chat-template does not render a chat: {type(exc).__name__}: {exc}") from exc
        return lm
