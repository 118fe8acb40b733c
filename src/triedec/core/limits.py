"""What one batch may hold and one forward may carry (:class:`BatchLimits`), and the prompt chunk
(:data:`PREFILL_CHUNK`). Declarations only, without torch: the engine applies them
(:class:`~triedec.engine.batch.Batch`), and ``triedec serve --help`` shows them without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from triedec.core.errors import positive_int
from triedec.core.settings import MIB, setting

PREFILL_CHUNK = 128
"""Prompt tokens per prefill forward: long prompts are prefilled in chunks beside other requests'
decoding steps (so a long prompt holds the others' steps no longer than one chunk's forward),
at fixed offsets so that a prompt's arithmetic never depends on the load."""


@dataclass(frozen=True)
class BatchLimits:
    """What one batch may hold and one forward may carry.

    * ``max_running``: requests decoded together (more wait for a slot);
    * ``max_tokens_per_forward``: tokens one forward carries at most: prompt chunks and optional
      draft nodes stop there (every running request's root and required nodes always go);
    * ``max_prefill_tokens``: prompt tokens per forward, in whole chunks of
      :data:`PREFILL_CHUNK` (at least one chunk, so a prompt always progresses);
    * ``max_kv_bytes``: KV memory the running requests may reserve (None: no cap); a request that
      would not fit waits, one that could never fit is refused;
    * ``persist_every``: finished requests between two writes of learned-state files.
    """

    max_running: int = setting(16, help="requests decoded together, one forward per step for all")
    max_tokens_per_forward: int = setting(512, help="tokens one forward carries at most: draft nodes and prompt "
                                                    "chunks")
    max_prefill_tokens: int = setting(2 * PREFILL_CHUNK, help=f"prompt tokens per forward beside the running "
                                                              f"requests, in {PREFILL_CHUNK}-token chunks")
    max_kv_bytes: int | None = setting(None, flag="--max-kv-mib", scale=MIB, unit="MiB", none="no cap",
                                       help="KV cache memory the running requests may reserve, MiB")
    persist_every: int = setting(16, help="finished requests between writes of learned-state files; they are also "
                                          "written when idle and at shutdown")

    def __post_init__(self) -> None:
        for name in ("max_running", "max_tokens_per_forward", "max_prefill_tokens", "persist_every"):
            positive_int(name, getattr(self, name))
        if self.max_kv_bytes is not None:
            positive_int("max_kv_bytes", self.max_kv_bytes)
