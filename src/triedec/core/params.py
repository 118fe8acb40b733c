"""What a user chooses, declared without torch: the sampling parameters (:class:`Sampling`), a
request's defaults (:data:`MAX_NEW_TOKENS`, :data:`DEFAULT_METHOD`), what it asks to see of each
token's probability (:class:`Logprobs`) and the weight modes
(:data:`WEIGHTS`, :data:`DEFAULT_WEIGHTS`, :data:`GROUP_SIZE`).

Pure core: imports only :mod:`triedec.core.errors` and the standard library, so that ``triedec COMMAND
--help`` shows these defaults without importing torch. The modules that act on them re-export
them (:mod:`triedec.core.sampling`, :mod:`triedec.api.generation`, :mod:`triedec.model.precision`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from triedec.core.errors import TriedecError

MAX_NEW_TOKENS = 256
"""The default number of new tokens a request may generate, everywhere: the Python API, the CLI,
the benchmark and the server (its ``--max-tokens``)."""

DEFAULT_METHOD = "auto"
"""The method a request uses when it names none."""

WEIGHTS = ("float", "int8", "int4", "int4-a8")
"""The weight modes: in the activation dtype, int8 per output row, int4 in groups, and int4 whose
dot products run on activations quantized to int8 per group (as llama.cpp runs a Q4 file)."""
AUTO_WEIGHTS = "auto"
"""What a load may ask for instead of a mode: ``int4-a8`` for a GGUF file stored in 4 bits on a CPU
whose vector instructions triedec's 8-bit-activation kernels use (AVX2 or AVX512-VNNI), with no
dtype or bfloat16 asked for; ``float`` for anything else (an HF checkpoint keeps its weights)
(:meth:`triedec.model.source.ModelSource.load_hf`)."""
WEIGHT_CHOICES = (AUTO_WEIGHTS, *WEIGHTS)
"""What ``weights=`` and ``--weights`` accept."""
DEFAULT_WEIGHTS = AUTO_WEIGHTS
"""The weights a load uses when it names none (the Python API, the CLI, the server, the benchmark)."""
GROUP_SIZE = 32
"""Input features per int4 group (the group size of GGUF's Q4_0 and Q4_1 blocks)."""

MAX_SEED = 2**64
"""Seeds are integers in ``[0, MAX_SEED)``."""
PENALTY_RANGE = (1e-6, 1e6)
"""The repetition penalties accepted: beyond them a float32 logit divided (or multiplied) by the
penalty overflows to infinity, and a distribution with infinite logits is no distribution."""


OPENAI_PENALTY_RANGE = (-2.0, 2.0)
"""The presence and frequency penalties accepted (OpenAI's range)."""
LOGIT_BIAS_RANGE = (-100.0, 100.0)
"""The logit biases accepted (OpenAI's range)."""
MAX_LOGIT_BIAS = 1024
"""The most token ids one request may bias."""


def _bias_pairs(given: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``(id, bias)`` pairs sorted by id, checked (see :class:`Sampling`)."""
    if isinstance(given, dict):
        items = list(given.items())
    elif isinstance(given, list | tuple) and all(isinstance(p, list | tuple) and len(p) == 2 for p in given):
        items = [tuple(p) for p in given]
    else:
        raise TriedecError(f"logit_bias must map token ids to biases, got {type(given).__name__}")
    if len(items) > MAX_LOGIT_BIAS:
        raise TriedecError(f"logit_bias may bias at most {MAX_LOGIT_BIAS} token ids, got {len(items)}")
    pairs: dict[int, float] = {}
    low, high = LOGIT_BIAS_RANGE
    for key, value in items:
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12 and key == str(int(key)):
            token = int(key)  # in its canonical form only ("5", not "05": two keys could name one token)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise TriedecError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        if token in pairs:
            raise TriedecError(f"logit_bias names token id {token} twice")
        if not low <= _number("a logit_bias value", value) <= high:
            raise TriedecError(f"logit_bias values must lie in [{low:g}, {high:g}], got {value!r} for token {token}")
        pairs[token] = float(value)
    return tuple(sorted(pairs.items()))


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TriedecError(f"{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Sampling:
    """How each next token is chosen. The defaults are greedy decoding.

    * ``temperature`` >= 0: 0 = greedy (the argmax after the repetition penalty); > 0 = sampling;
      a temperature so small that ``logits / temperature`` overflows float32 (below ~1e-37) is the
      limit of sampling as it goes to 0: greedy's token (:func:`process`);
    * ``top_k`` >= 0: keep the k most likely tokens (ties at the k-th kept); 0 = off;
    * ``top_p`` in (0, 1]: keep the most likely tokens whose mass reaches top_p; 1 = off;
    * ``min_p`` in [0, 1]: drop tokens less likely than min_p x the top token's probability; 0 = off;
    * ``repetition_penalty`` in [1e-6, 1e6] (:data:`PENALTY_RANGE`): the logit of every token
      already in the prefix (prompt included) is divided by it if positive, multiplied if negative
      (transformers' CTRL penalty); 1 = off;
    * ``seed``: an integer in [0, 2**64), or None (the API then draws one and reports it);
    * ``presence_penalty`` and ``frequency_penalty`` in [-2, 2] (:data:`OPENAI_PENALTY_RANGE`;
      OpenAI's): subtracted from the logit of every token the output so far holds (the prompt
      excluded, as vLLM does), once, and once per occurrence; 0 = off;
    * ``logit_bias``: token id -> bias in [-100, 100] added to its logit (OpenAI's; given as a
      mapping, with ids as integers or as the decimal strings OpenAI's JSON sends, or as pairs;
      kept as ``(id, bias)`` pairs sorted by id; at most :data:`MAX_LOGIT_BIAS` of them);
    * ``min_tokens`` >= 0: end-of-sequence and stop token ids get no mass, and stop strings do not
      stop, before this many tokens are out (vLLM's); 0 = off.

    The order a row is processed in: logit bias, ``min_tokens``' suppression, repetition penalty,
    presence and frequency penalties, then temperature, top-k, top-p and min-p.

    Unlike ``model.generate``, nothing comes from the model's generation config: a parameter left
    at its default is off.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if _number("temperature", self.temperature) < 0:
            raise TriedecError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise TriedecError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not 0 < _number("top_p", self.top_p) <= 1:
            raise TriedecError(f"top_p must lie in (0, 1] (1 = off), got {self.top_p!r}")
        if not 0 <= _number("min_p", self.min_p) <= 1:
            raise TriedecError(f"min_p must lie in [0, 1] (0 = off), got {self.min_p!r}")
        low, high = PENALTY_RANGE
        if not low <= _number("repetition_penalty", self.repetition_penalty) <= high:
            raise TriedecError(f"repetition_penalty must lie in [{low:g}, {high:g}] (1 = off; beyond, float32 logits "
                               f"overflow), got {self.repetition_penalty!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED):
            raise TriedecError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
        low, high = OPENAI_PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            if not low <= _number(name, getattr(self, name)) <= high:
                raise TriedecError(f"{name} must lie in [{low:g}, {high:g}] (0 = off), got {getattr(self, name)!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise TriedecError(f"min_tokens must be an integer >= 0 (0 = off), got {self.min_tokens!r}")

    @property
    def greedy(self) -> bool:
        """True for greedy decoding (``temperature == 0``)."""
        return self.temperature == 0

    @property
    def adjusts(self) -> bool:
        """True when a row's logits are changed before temperature and the filters: a logit bias,
        ``min_tokens``, or a penalty (so greedy decoding takes the argmax of the changed row)."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty
                    or self.logit_bias or self.min_tokens)

    def adjusts_from(self, position: int) -> bool:
        """True when :attr:`adjusts` holds for some row at output position ``position`` or later
        (``min_tokens`` stops holding back ids once that many tokens are out)."""
        return bool(self.reads_prefix or self.logit_bias or position < self.min_tokens)

    @property
    def reads_prefix(self) -> bool:
        """True when processing a row reads the tokens of its prefix (a penalty applies)."""
        return bool(self.repetition_penalty != 1.0 or self.presence_penalty or self.frequency_penalty)

    @property
    def plain(self) -> bool:
        """True when the processing changes nothing that greedy decoding sees: greedy, nothing
        adjusted (what beam search, which applies no processors, accepts)."""
        return self.greedy and not self.adjusts

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


MAX_TOP_LOGPROBS = 20
"""The most alternatives a request may ask to see per token (OpenAI's cap for ``top_logprobs``)."""
LOGPROB_MODES = ("raw", "processed")
"""Which distribution logprobs describe: ``raw``, the model's own log-softmax of its float32 logits
(vLLM's default), or ``processed``, the distribution the token was chosen from (after the
repetition penalty, temperature, top-k, top-p and min-p; at temperature 0, after the penalty)."""


@dataclass(frozen=True)
class Logprobs:
    """What a request asks to see of each generated token's probability: its logprob and the
    ``top`` most likely tokens' (0 to :data:`MAX_TOP_LOGPROBS`), in distribution ``mode``
    (:data:`LOGPROB_MODES`); with ``prompt``, each prompt token's after the first too (scoring a
    text, as evaluation harnesses do), with ``prompt_top`` alternatives (None: ``top``) and, with
    ``prompt_ranks``, each prompt token's rank (vLLM's ``prompt_logprobs`` show it)."""

    top: int = 0
    mode: str = "raw"
    prompt: bool = False
    prompt_top: int | None = None
    prompt_ranks: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.top, bool) or not isinstance(self.top, int) or not 0 <= self.top <= MAX_TOP_LOGPROBS:
            raise TriedecError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top!r}")
        if self.mode not in LOGPROB_MODES:
            raise TriedecError(f"logprobs_mode must be one of {', '.join(LOGPROB_MODES)}, got {self.mode!r}")
        if not isinstance(self.prompt, bool):
            raise TriedecError(f"prompt_logprobs must be true or false, got {self.prompt!r}")
        top = self.prompt_top
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise TriedecError(f"prompt_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}")

    @property
    def prompt_alternatives(self) -> int:
        """How many alternatives each prompt token's entry carries."""
        return self.top if self.prompt_top is None else self.prompt_top


SAMPLING_FIELDS = tuple(f.name for f in fields(Sampling))
"""The sampling parameters' names (transformers' names; the server's request fields too)."""

GREEDY_SAMPLING = Sampling()
"""The defaults: greedy decoding."""



@dataclass(frozen=True)
class CalibrationEffort:
    """How much a device calibration measures (:mod:`triedec.api.calibration`)."""

    prompts: int
    """calibration prompts a profile is measured on (the first warms up)"""
    max_new_tokens: int
    """tokens generated per calibration prompt"""
    repeats: int
    """timed repeats per measured size of the cost model (the median is kept)"""


CALIBRATION_EFFORTS: dict[str, CalibrationEffort] = {
    "full": CalibrationEffort(prompts=6, max_new_tokens=96, repeats=5),
    "quick": CalibrationEffort(prompts=2, max_new_tokens=48, repeats=1),
}
"""The calibration efforts, by name. ``full`` is the default and what ``triedec calibrate``
measures; ``quick`` takes about a fifth of the time for a noisier cost curve and profile (a test
suite's, or a machine that is only passing through). A calibration records its effort: a quick one
is measured again, in full, when a full one is asked for; a full one serves a quick request."""
DEFAULT_CALIBRATION_EFFORT = "full"
CALIBRATION_EFFORT_ENV = "TRIEDEC_CALIBRATION"
"""The environment variable that, when set, names the effort of the calibrations a process
measures on first use (``quick`` or ``full``): every ``triedec`` process a script or a test suite
starts gets it."""
