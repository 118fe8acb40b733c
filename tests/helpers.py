"""Shared test helpers (not a test module): tiny random-weight models, a tiny tokenizer, the
default-model prompts, transformers references, made-up cost curves and recycling profiles, and
small tree utilities. Tests import from here; test modules never import each other."""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from triedec.core.allocate import allocate
from triedec.core.costmodel import CostModel
from triedec.core.sampling import GREEDY_SAMPLING, Sampling
from triedec.core.tree import TokenTree
from triedec.drafters import BaseDrafter, ModelInfo, Verified
from triedec.drafters.template import PAPER_TEMPLATE, RecyclingProfile, best_nodes
from triedec.engine.batch import Batch, BatchLimits, run_alone, speculative_decode
from triedec.engine.request import StopRule
from triedec.model.adapter import ModelAdapter

TINY_VOCAB = 48
EOS = 2
CPU = torch.device("cpu")


# ---- tiny models --------------------------------------------------------------------------------


def tiny_llama(vocab: int = TINY_VOCAB, seed: int = 0, attn: str = "sdpa", max_pos: int = 512,
               intermediate: int = 128) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
        eos_token_id=EOS, bos_token_id=1, pad_token_id=0, attn_implementation=attn,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma3(vocab: int = TINY_VOCAB, seed: int = 0, attn: str = "sdpa", window: int = 6) -> Gemma3ForCausalLM:
    """Gemma3-like: sliding-window layers (small window) interleaved with full-attention layers."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
        sliding_window=window, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        eos_token_id=EOS, bos_token_id=1, pad_token_id=0, attn_implementation=attn,
    )
    return Gemma3ForCausalLM(cfg).eval()


def peaked(model: Any, scale: float = 20.0) -> Any:
    """``model`` with its LM head scaled up: next-token distributions concentrate on a few tokens
    (mean top probability ~0.5 for the tiny Llama), as a trained model's do, so that sampled drafts
    get accepted and sampling tests have a distribution worth comparing."""
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        if head is not model.get_input_embeddings().weight:
            head.mul_(scale)
        else:  # tied: scale the head only, through a copy
            model.lm_head.weight = torch.nn.Parameter(head * scale)
    return model


MODELS = {
    "llama-sdpa": lambda: tiny_llama(attn="sdpa"),
    "llama-eager": lambda: tiny_llama(attn="eager"),
    "gemma3-sdpa": lambda: tiny_gemma3(attn="sdpa"),
    "gemma3-eager": lambda: tiny_gemma3(attn="eager"),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "Hello there! How are you today? Tell me a story about the sea, the sky and the city.",
    "def quicksort(arr):\n    return sorted(arr)\n# Tests\nassert quicksort([2, 1]) == [1, 2]",
    "Translate to French: good morning. Summarize the article in one sentence, please.",
    "one two three four five six seven eight nine ten. Repeat: one two three.",
]


def tiny_tokenizer() -> Any:
    """A small byte-level BPE tokenizer (~400 tokens) with a ChatML-style chat template, trained
    on a few sentences: any text encodes, and no file outside the test is needed."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(path: Path, seed: int = 0) -> Path:
    """A tiny random Llama with :func:`tiny_tokenizer`, saved as a model directory at ``path``."""
    tokenizer = tiny_tokenizer()
    model = tiny_llama(vocab=len(tokenizer), seed=seed, max_pos=512)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_info(vocab: int = TINY_VOCAB, cost: CostModel | None = None, profile: RecyclingProfile | None = None,
              model_id: str = "tiny") -> ModelInfo:
    return ModelInfo(vocab, CPU, model_id, cost, {} if profile is None else {"recycling": profile})


# ---- references and decoding --------------------------------------------------------------------


def chi_square_same(a: Sequence[object], b: Sequence[object], min_expected: float = 5.0) -> tuple[float, float]:
    """Two-sample chi-square test that samples ``a`` and ``b`` come from one distribution:
    (statistic, p-value). Categories with fewer than ``min_expected`` expected counts in either
    sample are pooled into one."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    rare: tuple[float, float] = (0.0, 0.0)
    cells = []
    for key in set(ca) | set(cb):
        total = ca[key] + cb[key]
        if min(total * na, total * nb) / (na + nb) < min_expected:
            rare = (rare[0] + ca[key], rare[1] + cb[key])
        else:
            cells.append((ca[key], cb[key]))
    if sum(rare) * min(na, nb) / (na + nb) >= min_expected:
        cells.append(rare)
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = max(len(cells) - 1, 1)
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, p


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos=EOS) -> list[int]:
    """transformers' own greedy decoding: the ground truth."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
            eos_token_id=eos, pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt):].tolist()


def hf_generate(lm, ids: list[int], max_new_tokens: int) -> list[int]:
    """Stock transformers' greedy decoding of a loaded :class:`triedec.LM`'s model (unmodified:
    ``reference_model``; its own EOS settings)."""
    with torch.inference_mode():
        out = lm.reference_model().generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    return out[0, len(ids):].tolist()


def hf_beam(model, prompt, options: Any, max_new_tokens: int, eos) -> list[tuple[list[int], float]]:
    """transformers' beam search: the returned hypotheses (new tokens) and their scores."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), do_sample=False, num_beams=options.num_beams, max_new_tokens=max_new_tokens,
            num_return_sequences=options.num_return_sequences, length_penalty=options.length_penalty,
            early_stopping=options.early_stopping, eos_token_id=eos, pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            return_dict_in_generate=True, output_scores=True,
        )
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()
    seqs = out.sequences[:, len(prompt):].tolist()
    return [(s[:n], float(score)) for s, n, score in zip(seqs, lengths, out.sequences_scores.tolist(), strict=True)]


def drain(gen: Generator[list[int], None, Any]) -> tuple[list[int], Any]:
    """All tokens a decoding generator yields, and what it returns."""
    tokens: list[int] = []
    while True:
        try:
            tokens += next(gen)
        except StopIteration as done:
            return tokens, done.value


def alone(adapter, decoder, prompt, stop, documents=(), sampling: Sampling = GREEDY_SAMPLING, cost=None):
    """One request of a built method decoded alone (an engine batch of its own): (tokens, outcome)."""
    return drain(run_alone(adapter, decoder.start(prompt, stop, documents, sampling), cost))


def together(adapter, runs, cost=None, limits: BatchLimits | None = None, arrivals=None, cancel=None,
             batch: Batch | None = None):
    """Several runs decoded by one engine batch (one forward per step for all of them): run i is
    submitted before step ``arrivals[i]`` (default 0) and, if ``cancel`` maps it to a step, cancelled
    before that step. ``batch``: one the caller built (with its own cost, limits and options; then
    ``cost`` and ``limits`` are not used). Each run's (tokens, outcome or None if cancelled), and the
    batch's step count."""
    batch = batch if batch is not None else Batch(adapter, cost, limits)
    arrivals = arrivals or [0] * len(runs)
    cancel = cancel or {}
    tokens: list[list[int]] = [[] for _ in runs]
    pending = sorted(range(len(runs)), key=lambda i: arrivals[i])
    step = 0
    ids: dict[int, str] = {}
    while pending or not batch.idle:
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            ids[i] = batch.submit(runs[i], request_id=f"request-{i}")
        for i, when in cancel.items():
            if when == step:
                batch.cancel(ids[i])
        batch.step()
        for i, r in enumerate(runs):
            tokens[i] += r.take()
        step += 1
    batch.close()
    return [(t, None if i in cancel else r.outcome) for i, (t, r) in enumerate(zip(tokens, runs, strict=True))], step


def run(model, drafter, prompt, max_new_tokens, eos=EOS, documents=(), cost=None):
    """Decode ``prompt`` alone with ``drafter`` on ``model``, drafts sized under ``cost``:
    (tokens, stats)."""
    return drain(speculative_decode(ModelAdapter(model), drafter, prompt,
                                    StopRule(max_new_tokens, frozenset([eos])), documents, cost=cost))


def random_prompts(seed: int, count: int, vocab: int = TINY_VOCAB) -> list[list[int]]:
    """Token-id prompts; half repeat a motif so that lookup drafters find matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(1, 40)
        if rng.random() < 0.5:
            motif = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
            out.append((motif * 12)[:n])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(n)])
    return out


# ---- made-up device values ----------------------------------------------------------------------

FLAT_SECONDS = {1: 0.06, 2: 0.1, 3: 0.09, 5: 0.095, 9: 0.1, 17: 0.12, 33: 0.17, 65: 0.24, 81: 0.3}


def fake_cost(seconds: dict[int, float] | None = None) -> CostModel:
    return CostModel(FLAT_SECONDS if seconds is None else seconds)


def monotone_rates(seed: int = 0) -> list[float]:
    """Made-up acceptance rates that shrink with depth and rank (children below parents)."""
    g = torch.Generator().manual_seed(seed)
    by_path: dict[tuple[int, ...], float] = {}
    for p in PAPER_TEMPLATE.paths:
        parent = by_path.get(p[:-1], 1.0)
        by_path[p] = parent * float(torch.rand(1, generator=g)) / (1 + p[-1])
    return [by_path[p] for p in PAPER_TEMPLATE.paths]


def fake_profile(nodes: int | None = None, rates: Sequence[float] | None = None) -> RecyclingProfile:
    """A recycling profile from made-up rates; ``nodes`` None = the size the flat cost curve picks."""
    rates = list(rates or monotone_rates())
    return RecyclingProfile(tuple(rates), best_nodes(rates, fake_cost()) if nodes is None else nodes)


# ---- tree utilities -----------------------------------------------------------------------------


def sized(draft, cost) -> TokenTree:
    """The part of ``draft`` the engine verifies when its request runs alone under ``cost``."""
    return draft.tree.truncated(allocate([draft.chances], [draft.required], cost)[0])


def verified_part(draft, cost, logits, acceptance) -> Verified:
    """What the engine tells the drafter after verifying the part of ``draft`` that pays alone."""
    tree = sized(draft, cost)
    return Verified(tree, logits[: tree.size], acceptance, tuple(range(tree.size)), draft.size)



def path_to(tree: TokenTree, node: int) -> tuple[int, ...]:
    """Node indices from the root to ``node`` inclusive."""
    path = [node]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    return tuple(reversed(path))


def leaves(tree: TokenTree) -> tuple[int, ...]:
    return tuple(i for i in range(tree.size) if not tree.child_lists[i])


def root_paths(tree: TokenTree) -> list[tuple[int, ...]]:
    """Root-to-leaf paths as node indices, one per leaf, in leaf order."""
    return [path_to(tree, leaf) for leaf in leaves(tree)]


# ---- default-model prompts ----------------------------------------------------------------------

ARTICLE = (
    "The city council voted on Tuesday to expand the bike lane network by 40 kilometres over the next "
    "three years. The plan, which costs 12 million euros, connects the northern suburbs to the central "
    "station and adds 2,000 parking spaces for bicycles. Supporters said the project would cut traffic "
    "and pollution, while opponents argued that the money should go to bus services instead. The mayor "
    "said construction would begin in the spring and that residents would be consulted on each section."
)
CODE = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
'''
LONG = " ".join([ARTICLE] * 9)  # ~1,000 tokens of context

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Give me three tips for staying focused while studying."}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Explain what a hash table is in two sentences."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List the planets of the solar system."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a fun fact about octopuses."}],
    [{"role": "user", "content": f"Summarize this article in one sentence.\n\n{ARTICLE}"}],
    [{"role": "user", "content": f"What does the plan connect? Answer using the article.\n\n{ARTICLE}"}],
    [{"role": "user", "content": f"Rewrite this text in simpler words:\n\n{ARTICLE}"}],
    [{"role": "user", "content": "Translate to English: Der Hund schläft unter dem Tisch."}],
    [{"role": "user", "content": "Translate to French: I would like a cup of coffee, please."}],
    [{"role": "user", "content": "Translate to German: The weather is nice today."}],
    [{"role": "user", "content": f"Add type hints and a docstring to this code:\n\n{CODE}"}],
    [{"role": "user", "content": f"Rewrite this function iteratively:\n\n{CODE}"}],
    [{"role": "user", "content": "Write a Python function that checks whether a string is a palindrome."}],
    [{"role": "user", "content": "Write a SQL query that counts users per country."}],
    [{"role": "user", "content": "If I have 3 apples and buy 5 more, then eat 2, how many are left?"}],
    [{"role": "user", "content": f"{LONG}\n\nQuestion: how much does the plan cost?"}],
    "The history of the printing press begins",
    "def quicksort(arr):\n",
    CODE + "\n# Tests\nassert fibonacci(10) ==",
    [0, 1, 2, 3, 4],  # raw token ids
]


def absorbed_after(sharing: Callable[[], dict], before: int, seconds: float, what: str = "absorbed") -> float:
    """Seconds until a process's ``sharing`` status (``GET /health``'s) counts more than ``before``
    of ``what`` (``"outputs"``: finished outputs, the answers themselves; an entry of matrix rows
    or rates may come first) (fails past ``seconds``)."""
    start = time.monotonic()
    while (now := sharing())[what] <= before:
        assert time.monotonic() - start < seconds, f"nothing absorbed within {seconds} s: {now}"
        time.sleep(0.05)
    return time.monotonic() - start


def quiet(sharing: Callable[[], dict], seconds: float, what: str = "absorbed") -> int:
    """Wait until a process's ``sharing`` status has counted nothing more of ``what`` for
    ``seconds``; that count."""
    count, since = sharing()[what], time.monotonic()
    while time.monotonic() - since < seconds:
        time.sleep(0.1)
        now = sharing()[what]
        if now != count:
            count, since = now, time.monotonic()
    return count


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """Debian's redis-server on a loopback port, without persistence (a restart loses its data)."""

    def __init__(self, directory: Path) -> None:
        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed: scripts/setup.sh installs Debian's redis-server"
        self.exe, self.directory, self.port = exe, directory, free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen([self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.directory)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port)
        deadline = time.time() + 20
        while True:
            with contextlib.suppress(redis.RedisError):
                if client.ping():
                    return
            assert self.proc.poll() is None and time.time() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


# ---- drafters that know the answer ----------------------------------------------------------------


class OracleDrafter(BaseDrafter):
    """Test-only drafter: proposes trees that mix the true greedy continuation (known in advance)
    with wrong branches, at random depths, so every acceptance length and branch layout occurs."""

    def __init__(self, truth: list[int], prompt_len: int, seed: int, vocab: int = TINY_VOCAB) -> None:
        self.truth, self.prompt_len, self.vocab = truth, prompt_len, vocab
        self.rng = random.Random(seed)

    def propose(self, context):
        done = len(context) - self.prompt_len
        right = self.truth[done : done + self.rng.randint(0, 8)]
        keep = self.rng.randint(0, len(right))
        seqs = []
        for _ in range(self.rng.randint(0, 4)):  # wrong branches off the correct path
            cut = self.rng.randint(0, keep)
            seqs.append(right[:cut] + [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(1, 4))])
        seqs.append(right[:keep] if self.rng.random() < 0.5 else right)
        self.rng.shuffle(seqs)
        return TokenTree.from_sequences(context[-1], seqs)


def cache_with_built_kernels(cache: Path) -> Path:
    """``cache`` (created) as a fresh triedec cache whose compiled kernels are this process's, by a
    link: a ``triedec serve`` subprocess started on it does not build the extension again (one to
    two minutes on two cores, two at once in the scale-out tests), which is not what those tests test."""
    from triedec.core.paths import cache_root
    from triedec.model.native import load_kernel

    load_kernel()
    cache.mkdir(parents=True, exist_ok=True)
    link = cache / "kernels"
    if not link.exists():
        link.symlink_to(cache_root() / "kernels", target_is_directory=True)
    return cache
